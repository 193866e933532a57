import hashlib
import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastictrain.checkpoint import commit
from elastictrain.checkpoint.commit import CommittingWriter
from elastictrain.checkpoint.manifest import MANIFEST_NAME, MARKER_NAME, CheckpointMetadata, sha256_bytes

from .conftest import small_state


def test_commit_writes_data_then_metadata_then_manifest_then_marker_last(storage, monkeypatch):
    phases = []
    monkeypatch.setattr(commit, "PHASE_HOOK", lambda phase, rank, step: phases.append(
        (phase, sorted(os.listdir(storage.path("step-00000007"))) if os.path.isdir(storage.path("step-00000007"))
         else [])))
    writer = CommittingWriter(storage, "step-00000007", CheckpointMetadata(step=7, world_size=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(small_state(7), storage_writer=writer, no_dist=True)
    names = [p for p, _ in phases]
    assert names == ["before_data", "after_data", "after_dcp_metadata", "after_manifest", "after_marker"]
    listing = dict(phases)
    assert MARKER_NAME not in listing["after_manifest"] and MANIFEST_NAME in listing["after_manifest"]
    assert MANIFEST_NAME not in listing["after_dcp_metadata"] and ".metadata" in listing["after_dcp_metadata"]
    assert MARKER_NAME in listing["after_marker"]


def test_manifest_lists_every_file_with_its_real_size_and_sha256(storage, make_checkpoint):
    d = make_checkpoint(3)
    root = storage.path(d)
    manifest = json.loads(open(os.path.join(root, MANIFEST_NAME), "rb").read())
    data_files = sorted(n for n in os.listdir(root) if n not in (MANIFEST_NAME, MARKER_NAME))
    assert sorted(f["name"] for f in manifest["files"]) == data_files
    for f in manifest["files"]:
        blob = open(os.path.join(root, f["name"]), "rb").read()
        assert f["size"] == len(blob) and f["sha256"] == hashlib.sha256(blob).hexdigest()
    marker = json.loads(open(os.path.join(root, MARKER_NAME), "rb").read())
    assert marker == {"step": 3, "manifest_sha256": sha256_bytes(open(os.path.join(root, MANIFEST_NAME), "rb").read())}


def test_resaving_a_step_uncommits_it_before_writing_data(storage, make_checkpoint, monkeypatch):
    d = make_checkpoint(4)

    def crash_before_data(phase, rank, step):
        if phase == "before_data":
            raise OSError("disk gone")

    monkeypatch.setattr(commit, "PHASE_HOOK", crash_before_data)
    writer = CommittingWriter(storage, d, CheckpointMetadata(step=4, world_size=1))
    # DCP raises CheckpointException, a BaseException
    with warnings.catch_warnings(), pytest.raises(BaseException):  # noqa: B017
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.zeros(2)}}, storage_writer=writer, no_dist=True)
    assert not os.path.exists(storage.path(d, MARKER_NAME))
