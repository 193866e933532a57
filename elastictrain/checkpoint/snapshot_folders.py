"""Where the snapshot tier lives on a node and what it holds, read without torch.

The agent makes one folder per run under `snapshot_base()`, named `<run>-<agent pid>`; each rank's `SnapshotStore`
(checkpoint/snapshot.py) writes `rank<r>/slot<k>.bin|.meta|.json` in it, the `.json` being the slot's commit marker
(a `SnapshotInfo`: step, slot, nbytes, checksum, identity). Operator commands (`elastictrain ckpt ls`) and the
snapshot budget read the tier from here: plain files and JSON, so that they start without importing torch.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

RUN_FOLDER = re.compile(r"^(?P<run>.+)-(?P<pid>\d+)$")
"""The name of an agent's folder for one run: the run id (made path-safe), a dash, the agent's pid."""

_RANK_DIR = re.compile(r"^rank(\d+)$")


def snapshot_base() -> Path:
    """Node RAM (/dev/shm) when there is one, else the temp directory; one folder per user."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"elastictrain-snapshots-{os.getuid()}"


SLOTS = (0, 1, 2)
"""A rank's snapshot slots (checkpoint/snapshot.py): two rotate; the third is used while a durable save is written
from one of them (the slot it reads stays as it is until the upload is done)."""


@dataclass(frozen=True)
class CommittedSnapshot:
    """One committed slot of one rank, as its commit marker describes it."""

    rank: int
    step: int
    slot: int
    nbytes: int
    identity: dict[str, Any]
    """run, fingerprint, world_size and url of the job that wrote it."""


@dataclass
class RunFolder:
    """One agent's folder for one run, and the snapshots committed in it (each rank's newest first)."""

    path: Path
    run: Optional[str]
    """The run id from the folder's name (made path-safe); None for a folder not named like ours."""
    agent_pid: Optional[int]
    ranks: dict[int, list[CommittedSnapshot]] = field(default_factory=dict)
    """Every `rank<r>` folder, with its committed snapshots (empty before its first commit)."""


def committed(rank_dir: Path, rank: int) -> list[CommittedSnapshot]:
    """The committed slots of one rank's folder, newest first; a missing or half-written marker is not a commit."""
    out = []
    for slot in SLOTS:
        try:
            m = json.loads((rank_dir / f"slot{slot}.json").read_text())
            out.append(CommittedSnapshot(rank=rank, step=int(m["step"]), slot=int(m["slot"]),
                                         nbytes=int(m["nbytes"]), identity=dict(m["identity"])))
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return sorted(out, key=lambda s: -s.step)


def _children(path: Path) -> list[Path]:
    """The folders in `path`, by name; none when it is gone (an agent removing its folder as we look)."""
    try:
        return sorted((d for d in path.iterdir() if d.is_dir()), key=lambda d: d.name)
    except OSError:
        return []


def read_run_folder(path: Path) -> RunFolder:
    """One run folder: its run id and agent from its name, each rank's committed snapshots from their markers."""
    m = RUN_FOLDER.match(path.name)
    folder = RunFolder(path=path, run=m["run"] if m else None, agent_pid=int(m["pid"]) if m else None)
    for d in _children(path):
        r = _RANK_DIR.match(d.name)
        if r:
            folder.ranks[int(r[1])] = committed(d, int(r[1]))
    folder.ranks = dict(sorted(folder.ranks.items()))
    return folder


def run_folders(base: Path) -> list[Path]:
    """The folders under `base` (the node's snapshot base), by name; none when it is missing."""
    return _children(base)


def list_run_folders(base: Path) -> list[RunFolder]:
    """Every run folder under `base` (the node's snapshot base), by name."""
    return [read_run_folder(d) for d in _children(base)]


def bytes_held(folder: Path) -> int:
    """The bytes the files under `folder` occupy (allocated blocks: the slots' pages are reserved up front)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:  # removed meanwhile (a save replacing its marker)
                continue
    return total
