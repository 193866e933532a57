"""CheckpointManager across processes: FSDP2 + AdamW on gloo ranks, local directory and real S3 server."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from elastictrain.checkpoint.discovery import list_checkpoints
from elastictrain.checkpoint.storage import open_storage

from .dist_worker import free_port, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def assert_bitwise_equal(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(set(a) ^ set(b))}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def load(path: Path):
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """A 2-rank run to step 5 with async saves at 2 and 4 (uploads slowed by 1 s) into a local directory."""
    out = tmp_path_factory.mktemp("local")
    res = launch(2, {"scenario": "train", "url": str(out / "ck"), "steps": 5, "every_steps": 2,
                     "dump_at": [4, 5], "slow_upload_s": 1.0}, out / "train")
    return out, res


def test_async_save_blocks_only_while_staging(local_run):
    _, res = local_run
    for r in res:
        saved = {e[1]["step"]: e[1] for e in r["events"] if e[0] == "checkpoint_saved"}
        assert set(saved) == {2, 4}
        # the upload takes > 1 s (slowed on purpose); training was blocked only for staging
        assert saved[2]["total_s"] >= 1.0 and r["blocking"]["2"] < 0.5


def test_round_trip_same_world_size_is_bitwise_and_training_continues_identically(local_run):
    out, train = local_run
    res = launch(2, {"scenario": "resume", "url": str(out / "ck"), "continue_to": 5}, out / "resume2")
    assert [r["step"] for r in res] == [4, 4] and res[0]["trainer"] == {"step": 4, "samples": 48}
    assert [r["rng_sha"] for r in res] == [r["rng_sha"] for r in train]
    assert_bitwise_equal(load(out / "train" / "ref_step4.pt"), load(out / "resume2" / "loaded_w2.pt"))
    assert_bitwise_equal(load(out / "train" / "ref_step5.pt"), load(out / "resume2" / "cont_w2_step5.pt"))
    assert res[0]["losses"] == [train[0]["losses"][4]]


@pytest.mark.parametrize("world", [1, 3])
def test_resharding_load_to_another_world_size_is_bitwise_for_full_params_and_optimizer(local_run, world):
    out, _ = local_run
    res = launch(world, {"scenario": "resume", "url": str(out / "ck")}, out / f"resume{world}")
    assert all(r["step"] == 4 and r["ckpt_world_size"] == 2 for r in res)
    assert_bitwise_equal(load(out / "train" / "ref_step4.pt"), load(out / f"resume{world}" / f"loaded_w{world}.pt"))
    # per-rank RNG exists only for ranks 0 and 1 of the 2-rank run: rank 2 is told to re-derive it
    assert [r["missing_keys"] for r in res] == [[] if r < 2 else [f"rng/rank{r}"] for r in range(world)]


def test_fingerprint_mismatch_gives_a_clear_error(local_run):
    out, _ = local_run
    res = launch(2, {"scenario": "resume", "url": str(out / "ck"),
                     "fingerprint": {"model": "mlp-64", "data": "synthetic", "seed": "0"}}, out / "mismatch")
    msg = res[0]["mismatch"]
    assert "model (checkpoint mlp-48, this job mlp-64)" in msg and "checkpoint.resume=never" in msg
    assert "Traceback" not in msg and res[1]["mismatch"] == msg


def test_s3_round_trip_is_bitwise(s3_bucket, tmp_path):
    args = {"url": s3_bucket.url, "storage_options": s3_bucket.storage_options()}
    launch(2, {**args, "scenario": "train", "steps": 4, "every_steps": 2, "dump_at": [4]}, tmp_path / "train")
    res = launch(2, {**args, "scenario": "resume"}, tmp_path / "resume")
    assert [r["step"] for r in res] == [4, 4]
    assert_bitwise_equal(load(tmp_path / "train" / "ref_step4.pt"), load(tmp_path / "resume" / "loaded_w2.pt"))
    st = open_storage(s3_bucket.url, s3_bucket.storage_options())
    assert [(c.step, c.status) for c in list_checkpoints(st)] == [(4, "valid"), (2, "valid")]


def test_s3_server_stopped_during_a_save_training_continues_and_the_next_save_succeeds(tmp_path):
    root = tempfile.mkdtemp(prefix="elastictrain-s3-outage-")
    try:
        (Path(root) / "bkt").mkdir()
        port = free_port()
        opts = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k-outage", "secret": "s-outage",
                "client_kwargs": {"region_name": "us-east-1"},
                # fail fast while the server is down instead of botocore's default backoff
                "config_kwargs": {"retries": {"max_attempts": 2}, "connect_timeout": 1}}
        res = launch(2, {"scenario": "s3_outage", "url": "s3://bkt/run", "storage_options": opts,
                         "s3_root": root, "s3_port": port, "key": "k-outage", "secret": "s-outage"},
                     tmp_path / "outage", timeout_s=240)
        for r in res:
            kinds = [(e[0], e[1].get("step")) for e in r["events"] if e[0] != "checkpoint_deleted"]
            assert kinds == [("checkpoint_saved", 2), ("checkpoint_failed", 4), ("checkpoint_saved", 6),
                             ("checkpoint_saved", 8)]
            assert r["trained"] == list(range(1, 9)) and r["loaded_step"] == 8
        failed = [e for e in res[0]["events"] if e[0] == "checkpoint_failed"][0][1]
        assert "s3://bkt/run" in failed["url"] and failed["consecutive"] == 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_process_mode_async_save_round_trip_is_bitwise(tmp_path):
    url = str(tmp_path / "ck")
    train = launch(2, {"scenario": "train", "url": url, "steps": 4, "every_steps": 2, "dump_at": [4],
                       "async_mode": "process"}, tmp_path / "train")
    assert [e[0] for e in train[0]["events"]] == ["checkpoint_saved", "checkpoint_saved"]
    res = launch(2, {"scenario": "resume", "url": url}, tmp_path / "resume")
    assert [r["step"] for r in res] == [4, 4]
    assert_bitwise_equal(load(tmp_path / "train" / "ref_step4.pt"), load(tmp_path / "resume" / "loaded_w2.pt"))
