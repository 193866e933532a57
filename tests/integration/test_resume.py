"""Deterministic resume from checkpoints under real torchrun: kills, restarts, SIGTERM, other world sizes."""

import json
import math
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from elastictrain.checkpoint.discovery import list_checkpoints
from elastictrain.checkpoint.storage import open_storage
from elastictrain.runtime.audit import committed_timeline
from elastictrain.runtime.cursor import GlobalOrder
from tests.integration.recipe_runs import (
    assert_same_train_state,
    ledger_max_step,
    run_recipe,
    start_recipe,
    worker_pids,
)

pytestmark = pytest.mark.slow

STEPS = 16
GLOBAL_BATCH = 8


def expected_samples(step: int) -> list[int]:
    """What an uninterrupted run consumes at `step`: positions [step*G, (step+1)*G) of the global order."""
    order = GlobalOrder(1_000_000, seed=1234)  # the synthetic source's size and the config's seed
    return sorted(order.lookup(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)))


def wait_for_step(proc, out, step, timeout=180):
    deadline = time.monotonic() + timeout
    while ledger_max_step(out) < step:
        assert proc.poll() is None, f"run ended early with {proc.returncode}"
        assert time.monotonic() < deadline, "training made no progress"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ref")


@pytest.fixture(scope="module")
def reference(reference_dir):
    """An uninterrupted 2-rank run, checkpointing on the same schedule as the runs under test."""
    out = reference_dir
    return run_recipe(out, 2, [f"train.steps={STEPS}", f"checkpoint.url={out}/ckpt", "checkpoint.every_steps=4"])


def test_worker_sigkilled_at_a_random_step_resumes_bitwise_identical(tmp_path, reference):
    out = tmp_path / "run"
    ckpt = f"checkpoint.url={out}/ckpt"
    proc = start_recipe(out, 2, [f"train.steps={STEPS}", ckpt, "checkpoint.every_steps=4", "train.audit_samples=true"],
                        extra_torchrun=["--max-restarts=2"])
    try:
        kill_at = random.Random(os.getpid()).randint(5, 11)
        wait_for_step(proc, out, kill_at)
        victim = worker_pids(proc.pid)[1]
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=240) == 0, (out / "launcher.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["start_step"] > 0, "the restarted workers must resume from a checkpoint, not from scratch"
    assert_same_train_state(summary, reference)
    timeline = committed_timeline(out / "samples")
    assert timeline == {step: expected_samples(step) for step in range(STEPS)}


def test_sigterm_finishes_the_step_saves_and_resumes_bitwise(tmp_path, reference):
    out = tmp_path / "run"
    ckpt = f"checkpoint.url={out}/ckpt"
    proc = start_recipe(out, 2, [f"train.steps={STEPS}", ckpt, "checkpoint.every_steps=4", "train.audit_samples=true"])
    try:
        wait_for_step(proc, out, 5)
        os.kill(proc.pid, signal.SIGTERM)  # torchrun forwards it to its workers
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    saved = [c for c in list_checkpoints(open_storage(f"{out}/ckpt")) if c.valid]
    stopped_at = max(c.step for c in saved)
    assert stopped_at == ledger_max_step(out) + 1, "the stop checkpoint holds the last completed step"
    resumed = run_recipe(out, 2, [f"train.steps={STEPS}", ckpt, "checkpoint.every_steps=4", "train.audit_samples=true"])
    assert resumed["start_step"] == stopped_at
    assert_same_train_state(resumed, reference)


@pytest.mark.parametrize("nproc", [2, 3])
def test_loading_the_final_checkpoint_restores_parameters_and_optimizer_state_bitwise(tmp_path, reference,
                                                                                   reference_dir, nproc):
    """Nothing is left to train, so the summary's digests are those of the loaded state (resharded to `nproc`):
    a resume that restored the parameters but not the optimizer (moments, step counts, learning rate) shows only
    in the optimizer digest."""
    final = [c.url for c in list_checkpoints(open_storage(f"{reference_dir}/ckpt")) if c.valid and c.step == STEPS]
    assert final, "the reference saves its last step"
    loaded = run_recipe(tmp_path / "run", nproc, [f"train.steps={STEPS}", f"checkpoint.url={tmp_path}/ckpt",
                                                 f"checkpoint.resume={final[0]}"])
    assert loaded["start_step"] == loaded["final_step"] == STEPS and not loaded["losses"]
    assert_same_train_state(loaded, reference)


def optimizer_steps(ckpt: Path) -> set[float]:
    """The per-parameter AdamW step counts saved in a checkpoint directory."""
    reader = FileSystemReader(ckpt)
    prefix, suffix = "optim.state.", ".step"
    fqns = [k[len(prefix):-len(suffix)] for k in reader.read_metadata().state_dict_metadata
            if k.startswith(prefix) and k.endswith(suffix)]
    state = {"optim": {"state": {fqn: {"step": torch.zeros(())} for fqn in fqns}}}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {float(s["step"]) for s in state["optim"]["state"].values()}


def test_the_optimizer_stepped_once_per_training_step(reference, reference_dir):
    """AdamW's step count (its bias correction) in every checkpoint equals the training step: nothing stepped the
    optimizer outside training (torch's get_optimizer_state_dict, for one, runs a zero-lr step on an optimizer
    that has no state yet, and bitwise comparisons between runs of the same code do not see it)."""
    saved = [c for c in list_checkpoints(open_storage(f"{reference_dir}/ckpt")) if c.valid]
    assert saved, "the reference saves checkpoints"
    for c in saved:
        assert optimizer_steps(reference_dir / "ckpt" / c.dirname) == {float(c.step)}, c.dirname


def test_resume_across_world_sizes_2_1_3_consumes_every_sample_exactly_once(tmp_path, reference):
    out = tmp_path / "run"
    common = [f"checkpoint.url={out}/ckpt", "checkpoint.every_steps=4", "train.audit_samples=true",
              f"train.steps={STEPS}"]
    run_recipe(out, 2, [*common, "train.stop_at=6"])
    run_recipe(out, 1, [*common, "train.stop_at=11"])
    last = run_recipe(out, 3, common)
    assert last["start_step"] == 11 and last["final_step"] == STEPS
    # every step holds exactly the samples an uninterrupted run would have consumed, each once
    assert committed_timeline(out / "samples") == {step: expected_samples(step) for step in range(STEPS)}
    # the loss curve continues: the resharded run tracks the uninterrupted reference closely
    for step, loss in last["losses"].items():
        assert math.isclose(loss, reference["losses"][step], rel_tol=1e-3), (step, loss, reference["losses"][step])
