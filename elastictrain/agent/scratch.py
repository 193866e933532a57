"""The agent's scratch folders in the temp directory (its workers' heartbeat socket, control file, warm spares'
files, torch's per-worker error files, an embedded etcd's data): named by the agent's pid, so that an agent started
later on the node removes those of agents that are gone. An agent removes its own at exit; one that was SIGKILLed (a
node kill, an OOM kill) could not, and without the sweep each such loss left its folders behind for good."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from elastictrain.runtime.heartbeat import pid_alive

KINDS = ("ctl", "hb", "warm", "logs", "etcd")
_NAME = re.compile(rf"^elastictrain-(?:{'|'.join(KINDS)})-(?P<pid>\d+)-")


def make_scratch_dir(kind: str) -> str:
    """A private (0700) folder for this agent's `kind` of scratch files; the caller removes it when done."""
    assert kind in KINDS, kind
    return tempfile.mkdtemp(prefix=f"elastictrain-{kind}-{os.getpid()}-")


def sweep_orphan_scratch(base: Optional[str] = None) -> list[Path]:
    """Remove this user's scratch folders whose agent is no longer running; returns them."""
    return sweep_dead_owners(Path(base or tempfile.gettempdir()), _NAME)


def sweep_dead_owners(root: Path, name: re.Pattern[str]) -> list[Path]:
    """Remove the folders under `root` that this user owns and whose name matches `name` with a `pid` group naming a
    process that no longer runs; returns them. A folder of a live pid stays (its agent, or an unrelated process that
    reuses the pid: then it goes at a later sweep). Also the agents' snapshot folders (agent/snapshots.py)."""
    removed: list[Path] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for d in entries:
        m = name.match(d.name)
        try:
            if not m or not d.is_dir() or d.stat().st_uid != os.getuid() or pid_alive(int(m["pid"])):
                continue
        except OSError:  # removed by another agent's sweep meanwhile
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed
