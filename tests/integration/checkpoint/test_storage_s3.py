"""Storage errors against a real S3 server: each names the URL and the fix; a down server never means 'start fresh'."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from elastictrain.checkpoint.manager import CheckpointManager
from elastictrain.checkpoint.storage import check_storage, open_storage
from elastictrain.config import CheckpointConfig
from elastictrain.errors import StorageError
from elastictrain.testing.s3server import S3Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
FAST_FAIL = {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}


def test_missing_bucket_names_the_bucket_and_the_fix(s3_bucket):
    with pytest.raises(StorageError) as e:
        check_storage(open_storage("s3://no-such-bucket/ckpt", s3_bucket.storage_options()))
    assert "bucket 'no-such-bucket' does not exist" in str(e.value) and "create it" in str(e.value)


def test_bad_credentials_say_so(s3_bucket):
    with pytest.raises(StorageError) as e:
        CheckpointManager(CheckpointConfig(url=s3_bucket.url, storage_options=s3_bucket.storage_options(
            secret="wrong")), fingerprint={})
    assert s3_bucket.url in str(e.value) and "refused the credentials" in str(e.value)


def test_unreachable_endpoint_says_so(s3_bucket):
    opts = s3_bucket.storage_options(endpoint_url="http://127.0.0.1:9", **FAST_FAIL)
    with pytest.raises(StorageError) as e:
        check_storage(open_storage(s3_bucket.url, opts))
    assert "http://127.0.0.1:9 is unreachable" in str(e.value) and "AWS_ENDPOINT_URL" in str(e.value)


def test_endpoint_and_credentials_from_the_standard_aws_environment(s3_bucket, monkeypatch):
    for k, v in s3_bucket.server.env().items():
        monkeypatch.setenv(k, v)
    mgr = CheckpointManager(CheckpointConfig(url=s3_bucket.url), fingerprint={})
    mgr.save(1, {"w": torch.arange(4.0)}, blocking=True)
    state = {"w": torch.zeros(4)}
    assert mgr.load_latest(state).step == 1 and torch.equal(state["w"], torch.arange(4.0))


def test_server_down_at_resume_is_a_storage_error_not_a_fresh_start(s3_bucket):
    cfg = CheckpointConfig(url=s3_bucket.url, storage_options=s3_bucket.storage_options(**FAST_FAIL))
    CheckpointManager(cfg, fingerprint={}).save(1, {"w": torch.ones(2)}, blocking=True)
    mgr = CheckpointManager(cfg, fingerprint={})
    s3_bucket.server.stop()
    try:
        with pytest.raises(StorageError, match="unreachable"):
            mgr.load_latest({"w": torch.zeros(2)})
    finally:
        s3_bucket.server.start()


def test_a_start_during_an_s3_outage_waits_for_the_server_then_saves():
    # A restart while the object store is down: the worker waits instead of failing (and spending the budget).
    server = S3Server()
    try:
        bucket = server.make_bucket(f"b-{uuid.uuid4().hex[:12]}")
        cfg = CheckpointConfig(url=f"s3://{bucket}/ckpt", storage_wait_s=60,
                               storage_options={**server.storage_options(), **FAST_FAIL})
        starter = threading.Timer(2.0, server.start)
        starter.start()
        events: list = []
        mgr = CheckpointManager(cfg, fingerprint={}, on_event=lambda n, f: events.append(n))
        starter.join()
        assert "checkpoint_storage_unreachable" in events
        assert mgr.save(1, {"w": torch.ones(2)}, blocking=True)
    finally:
        server.close()


def test_delta_checkpoints_on_s3_share_blobs_load_verify_and_retain(s3_bucket):
    """checkpoint.dedup + zstd on an object store: the frozen tensor is one object referenced by every checkpoint,
    DCP's `../blobs/...` item paths resolve (an object store takes `..` literally), retention deletes the blobs
    of deleted checkpoints only, and verification reads the referenced blobs back."""
    from elastictrain.checkpoint.blobs import is_blob
    from elastictrain.checkpoint.discovery import list_checkpoints, verify_files

    frozen = torch.randn(512, 256)
    cfg = CheckpointConfig(url=s3_bucket.url, storage_options=s3_bucket.storage_options(), dedup=True,
                           compression="zstd", keep_last=2, async_save=False)
    mgr = CheckpointManager(cfg, fingerprint={})
    for step in (1, 2, 3):
        assert mgr.save(step, {"frozen": frozen, "trained": torch.full((512, 256), float(step))}, blocking=True)
    kept = list_checkpoints(mgr.storage)
    assert [c.step for c in kept] == [3, 2] and all(verify_files(mgr.storage, c) == [] for c in kept)
    blobs = {n for n in mgr.storage.list_files() if is_blob(n)}
    assert blobs == {b.name for c in kept for b in c.manifest.blobs} and len(blobs) == 3
    state = {"frozen": torch.zeros(512, 256), "trained": torch.zeros(512, 256)}
    assert CheckpointManager(cfg, fingerprint={}).load_latest(state).step == 3
    assert torch.equal(state["frozen"], frozen) and torch.equal(state["trained"], torch.full((512, 256), 3.0))
