"""The node's directory for its workers' in-memory snapshots (checkpoint/snapshot.py): made per agent, removed
when the agent ends, and swept when a later agent finds one whose agent died without removing it."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Optional

from elastictrain.agent.scratch import sweep_dead_owners
from elastictrain.checkpoint.snapshot import ENV_SNAPSHOT_DIR, remove_snapshots
from elastictrain.checkpoint.snapshot_folders import RUN_FOLDER, read_run_folder, snapshot_base

log = logging.getLogger(__name__)


def sweep_orphans(base: Path) -> list[Path]:
    """Remove the snapshot folders of agents that are gone (SIGKILLed, a lost node that came back)."""
    return sweep_dead_owners(base, RUN_FOLDER)


def make_snapshot_dir(run_id: str) -> Path:
    """This agent's folder for `run_id`, exported to its workers (ELASTICTRAIN_SNAPSHOT_DIR); `remove` it at the end."""
    base = snapshot_base()
    for d in sweep_orphans(base):
        log.info("removed the in-memory snapshots of a gone agent: %s", d)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)
    path = base / f"{safe}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.environ[ENV_SNAPSHOT_DIR] = str(path)
    return path


def remove(path: Path) -> None:
    remove_snapshots(path)
    if os.environ.get(ENV_SNAPSHOT_DIR) == str(path):
        del os.environ[ENV_SNAPSHOT_DIR]


def newest_step(folder: Path) -> Optional[int]:
    """The newest snapshot step committed by any rank in this agent's folder (for `status`); None when none is."""
    steps = [held[0].step for held in read_run_folder(folder).ranks.values() if held]
    return max(steps) if steps else None
