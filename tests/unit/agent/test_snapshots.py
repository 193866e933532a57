"""The agent's snapshot folders: a folder whose agent died (SIGKILL, a lost node) is removed by the next agent on
the host, a live agent's folder never is, and a finished agent takes its own away."""

from __future__ import annotations

import os
import subprocess
import sys

from elastictrain.agent import snapshots
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
