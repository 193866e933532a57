"""What `elastictrain ckpt ls` shows of the snapshot tier: this node's run folders, per rank the committed snapshots
(step, size, world size) and whether the agent that owns the folder is alive; per folder the memory its node's
snapshots were last checked to need (`budget.json`: own slots and a peer's replicas) and the bytes it holds.

Read from the slots' JSON commit markers only (checkpoint/snapshot_folders.py): no torch, no snapshot data read.
A folder whose agent is gone holds nothing a restart can use (the next agent on this node removes it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from elastictrain.checkpoint.snapshot_budget import read_plan
from elastictrain.checkpoint.snapshot_folders import CommittedSnapshot, RunFolder, bytes_held, list_run_folders
from elastictrain.runtime.heartbeat import pid_alive


def root_key(url: str) -> str:
    """A checkpoint root in one spelling: `/a/b/`, `file:///a/b` and `a/b` (from /a) are the same root."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    if scheme.lower() in ("file", "local"):
        return "file://" + os.path.realpath(rest)
    return f"{scheme.lower()}://{rest.rstrip('/')}"


def _snapshot(s: CommittedSnapshot) -> dict[str, Any]:
    return {"step": s.step, "slot": s.slot, "bytes": s.nbytes, "world_size": s.identity.get("world_size"),
            "run": s.identity.get("run"), "url": s.identity.get("url")}


def _folder(f: RunFolder, url: Optional[str]) -> Optional[dict[str, Any]]:
    ranks = []
    for rank, held in f.ranks.items():
        shown = [s for s in held if url is None or root_key(str(s.identity.get("url"))) == root_key(url)]
        if shown or url is None:
            ranks.append({"rank": rank, "snapshots": [_snapshot(s) for s in shown]})
    if not ranks and url is not None:
        return None
    return {"folder": str(f.path), "run": f.run, "agent_pid": f.agent_pid,
            "agent_alive": f.agent_pid is not None and pid_alive(f.agent_pid), "ranks": ranks,
            "planned_bytes": read_plan(f.path) or None, "held_bytes": bytes_held(f.path)}


def snapshot_tier(base: Path, url: Optional[str]) -> dict[str, Any]:
    """The snapshot tier under `base` as JSON-able data: the snapshots of the job writing to checkpoint root `url`,
    or, with `url` None, every run folder and rank (those with nothing committed too)."""
    folders = [d for d in (_folder(f, url) for f in list_run_folders(base)) if d is not None]
    return {"base": str(base), "folders": folders}
