"""Supervised fine-tuning on packed chat data under real torchrun: a worker killed mid-run resumes bitwise at the
same world size, and a run resized 2 -> 1 -> 3 consumes every row exactly once, as the sample ledger shows."""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastictrain.checkpoint.blobs import is_blob
from elastictrain.checkpoint.discovery import list_checkpoints, verify_files
from elastictrain.checkpoint.storage import open_storage
from elastictrain.config import DataConfig
from elastictrain.runtime.audit import committed_timeline
from elastictrain.runtime.cursor import GlobalOrder
from elastictrain.runtime.data import build_source
from tests.fixtures.sft import VOCAB, chat_rows, make_tokenizer, write_parquet
from tests.integration.recipe_runs import (
    REPO,
    assert_same_train_state,
    ledger_max_step,
    run_recipe,
    start_recipe,
    worker_env,
    worker_pids,
)

pytestmark = pytest.mark.slow

STEPS = 8
GLOBAL_BATCH = 8
SEQ = 128
SEED = 1234  # configs/tiny-cpu.yaml's train.seed


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """A tokenizer without a chat template (the fallback renders) and 240 rows of mixed chat formats, as Parquet."""
    d = tmp_path_factory.mktemp("sft")
    rows = chat_rows(240, seed=5, messages=True)
    random.Random(0).shuffle(rows)
    cfg = DataConfig(source="parquet", path=str(write_parquet(d / "chat.parquet", rows)),
                     tokenizer=str(make_tokenizer(d / "tok")), seq_len=SEQ)
    packs = build_source(cfg, VOCAB, SEED).packs
    assert STEPS * GLOBAL_BATCH <= len(packs) < 240, "the run stays within one epoch of packed sequences"
    return {"cfg": cfg, "packs": packs, "rows": len(rows)}


def overrides(data: dict, out: Path) -> list[str]:
    c = data["cfg"]
    return ["data.source=parquet", f"data.path={c.path}", f"data.tokenizer={c.tokenizer}", f"data.seq_len={SEQ}",
            f"data.global_batch_size={GLOBAL_BATCH}", "data.micro_batch_size=2", f"model.overrides.vocab_size={VOCAB}",
            f"train.steps={STEPS}", f"checkpoint.url={out}/ckpt", "checkpoint.every_steps=2",
            "train.audit_samples=true"]


def expected_samples(data: dict, step: int) -> list[int]:
    """The rows an uninterrupted run trains on at `step`: those packed into the step's sequences of the order."""
    order = GlobalOrder(len(data["packs"]), seed=SEED)
    return sorted(s for p in order.lookup(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
                  for s in data["packs"].samples_of(p))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ref")
    summary = run_recipe(out, 2, overrides(data, out))
    summary["timeline"] = committed_timeline(out / "samples")
    return summary


def test_an_uninterrupted_run_trains_on_each_row_once_in_packed_sequences(data, reference):
    timeline = reference["timeline"]
    assert timeline == {step: expected_samples(data, step) for step in range(STEPS)}
    seen = [s for step in timeline.values() for s in step]
    assert len(seen) == len(set(seen)) and set(seen) <= set(range(data["rows"]))
    assert len(seen) > 1.5 * STEPS * GLOBAL_BATCH, "a packed sequence holds several rows"
    losses = [reference["losses"][str(s)] for s in range(1, STEPS + 1)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], "the response loss falls"


def test_a_worker_killed_mid_run_resumes_bitwise_identical(data, reference, tmp_path):
    out = tmp_path / "run"
    proc = start_recipe(out, 2, overrides(data, out), extra_torchrun=["--max-restarts=1"])
    try:
        deadline = time.monotonic() + 180
        while ledger_max_step(out) < 3:  # steps 0-3 done, the checkpoint of step 2 committed
            assert proc.poll() is None and time.monotonic() < deadline, (out / "launcher.log").read_text()[-3000:]
            time.sleep(0.05)
        os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
        assert proc.wait(timeout=240) == 0, (out / "launcher.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["start_step"] > 0, "the restarted workers resume from a checkpoint"
    assert_same_train_state(resumed, reference)
    assert committed_timeline(out / "samples") == reference["timeline"]


def test_a_resume_across_world_sizes_2_1_3_consumes_every_row_exactly_once(data, reference, tmp_path):
    """With delta checkpoints and zstd on (tensors of 4 KiB or more as blobs, so the tiny model's shards are): each
    resume reads blobs written at another world size, and retention leaves exactly the blobs kept checkpoints use."""
    out = tmp_path / "run"
    delta = ["checkpoint.dedup=true", "checkpoint.dedup_min_bytes=4096", "checkpoint.compression=zstd"]
    run_recipe(out, 2, [*overrides(data, out), *delta, "train.stop_at=3"])
    run_recipe(out, 1, [*overrides(data, out), *delta, "train.stop_at=5"])
    last = run_recipe(out, 3, [*overrides(data, out), *delta])
    assert last["start_step"] == 5 and last["final_step"] == STEPS
    assert committed_timeline(out / "samples") == reference["timeline"]
    for step, loss in last["losses"].items():
        assert math.isclose(loss, reference["losses"][step], rel_tol=1e-3), (step, loss, reference["losses"][step])
    storage = open_storage(str(out / "ckpt"))
    kept = [c for c in list_checkpoints(storage) if c.valid]
    used = {b.name for c in kept for b in c.manifest.blobs}
    assert used and all(n.endswith(".zst") for n in used)
    assert {n for n in storage.list_files() if is_blob(n)} == used
    assert all(verify_files(storage, c) == [] for c in kept)


def test_a_missing_dataset_file_ends_the_job_with_one_line_and_no_restart(data, tmp_path):
    missing = tmp_path / "gone.jsonl"
    sets = ["data.source=jsonl", f"data.path={missing}", f"data.tokenizer={data['cfg'].tokenizer}",
            f"model.overrides.vocab_size={VOCAB}", f"train.output_dir={tmp_path}/out", "checkpoint.url=null",
            "checkpoint.every_steps=0"]
    cmd = [sys.executable, "-m", "elastictrain.recipes.lm", "--config", str(REPO / "configs/tiny-cpu.yaml")]
    r = subprocess.run(cmd + [a for o in sets for a in ("--set", o)], cwd=REPO, env=worker_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]  # EXIT_FATAL: restarting cannot fix it
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and errors[0].endswith(f"data.path='{missing}' does not exist; point data.path at a local "
                                                   f"JSON-lines file"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
