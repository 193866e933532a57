"""The agent's snapshot and scratch folders: a folder whose agent died (SIGKILL, a lost node) is removed by the next
agent on the host, a live agent's folder never is, and a finished agent takes its own away."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from elastictrain.agent import scratch, snapshots
from elastictrain.checkpoint.snapshot import ENV_SNAPSHOT_DIR


def test_the_folders_of_dead_agents_are_swept_and_live_ones_kept(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"job-a-{gone.pid}"
    live = tmp_path / f"job-b-{os.getpid()}"
    other = tmp_path / "not-ours"
    for d in (dead, live, other):
        (d / "rank0").mkdir(parents=True)
    assert snapshots.sweep_orphans(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and other.exists()


def test_an_agent_exports_its_folder_and_removes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshots, "snapshot_base", lambda: tmp_path)
    monkeypatch.delenv(ENV_SNAPSHOT_DIR, raising=False)
    path = snapshots.make_snapshot_dir("run/with spaces")
    assert path.parent == tmp_path and path.name == f"run_with_spaces-{os.getpid()}"
    assert os.environ[ENV_SNAPSHOT_DIR] == str(path) and path.is_dir()
    (path / "rank0").mkdir()
    snapshots.remove(path)
    assert not path.exists() and ENV_SNAPSHOT_DIR not in os.environ


def test_the_scratch_folders_of_dead_agents_are_swept_and_live_ones_kept(tmp_path, monkeypatch):
    """The heartbeat socket's, control file's, warm spares', error files' and embedded etcd's folders of a SIGKILLed
    agent (a node kill) are removed by the next agent's start; a live agent's, and anything not named like ours,
    stay."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = [scratch.make_scratch_dir(kind) for kind in scratch.KINDS]
    assert all(os.path.basename(d).startswith(f"elastictrain-{k}-{os.getpid()}-") for d, k in zip(mine, scratch.KINDS))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = [tmp_path / f"elastictrain-{kind}-{gone.pid}-abc" for kind in scratch.KINDS]
    others = [tmp_path / "elastictrain-etcd-xyz", tmp_path / f"elastictrain-ctl-{gone.pid}"]  # not an agent's
    for d in dead + others:
        (d / "sub").mkdir(parents=True)
    assert sorted(scratch.sweep_orphan_scratch()) == sorted(dead)
    assert not any(d.exists() for d in dead)
    assert all(os.path.isdir(d) for d in mine) and all(d.exists() for d in others)
