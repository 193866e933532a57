"""Chaos injectors against a real S3 server (rclone serve s3 on loopback): corrupt a checkpoint, take the server down.

Every request carries the server's endpoint and credentials (nothing leaves 127.0.0.1).
"""

from __future__ import annotations

import random
import re
import socket
import time
import uuid

import pytest

from elastictrain.chaos import injectors
from elastictrain.checkpoint.discovery import find_latest_valid, list_checkpoints, verify_files
from elastictrain.checkpoint.storage import open_storage
from elastictrain.testing.s3server import S3Server
from tests.unit.checkpoint.conftest import write_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_corrupt_checkpoint_on_s3_is_caught_by_checksums(s3_bucket):
    opts = s3_bucket.storage_options()
    storage = open_storage(s3_bucket.url, opts)
    write_checkpoint(storage, 4)
    write_checkpoint(storage, 8)
    detail, heal = injectors.corrupt_checkpoint(s3_bucket.url, opts, random.Random(0))
    assert heal is None and "(step 8)" in detail
    storage = open_storage(s3_bucket.url, opts)
    newest = next(c for c in list_checkpoints(storage) if c.step == 8)
    assert any("sha256 mismatch" in p for p in verify_files(storage, newest))
    assert find_latest_valid(storage, verify=True).step == 4, "loading must fall back to the older checkpoint"


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_storage_down_kills_the_server_and_the_heal_brings_it_back_with_its_data():
    server = S3Server().start()
    relaunched = None
    try:
        bucket = server.make_bucket(f"b-{uuid.uuid4().hex[:12]}")
        storage = open_storage(f"s3://{bucket}/ckpt", server.storage_options())
        storage.write_bytes(b"kept", "probe")
        pid = injectors.listening_pid(server.endpoint_url)
        assert pid is not None, "the server is found by its endpoint's port"
        detail, heal = injectors.restart_server(pid, None, what="S3 server")
        assert detail == f"SIGKILL S3 server pid {pid}"
        assert injectors.wait_gone(pid, 10) and not _accepts(server.port)
        said = heal()
        relaunched = int(re.search(r"as pid (\d+)", said).group(1))
        deadline = time.monotonic() + 20
        while not _accepts(server.port):
            assert time.monotonic() < deadline, said
            time.sleep(0.1)
        storage = open_storage(f"s3://{bucket}/ckpt", server.storage_options())
        assert storage.read_bytes("probe") == b"kept"
    finally:
        if relaunched is not None and not injectors.is_gone(relaunched):
            injectors.process_signals.kill_node(relaunched)
            injectors.wait_gone(relaunched, 10)
        server.close()
