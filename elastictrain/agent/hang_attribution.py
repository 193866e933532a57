"""Which rank a job-wide hang started at, from the `hang` events every node's agent wrote (pure, torch-free).

When one rank stops, its peers stop too: they wait for it in the step's next collective, so every node's agent
declares its own workers hung within a second or two of each other, and each event alone names only that node's
workers. Read together (one incident: hang events within `INCIDENT_S` of the newest), the rank that stopped first
is, in this order: one whose process was found stopped or in uninterruptible sleep (SIGSTOP, a debugger, a dead
disk); else the one that reported the lowest step (its peers went one step further, into the collective it never
entered); else the one silent longest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

INCIDENT_S = 30.0
"""Hang events this close to the newest one belong to the same incident."""
CULPRIT_STATES = ("stopped", "tracing-stop", "disk-sleep")
"""Process states (psutil's) that make a hung worker the cause rather than a victim."""


@dataclass(frozen=True)
class HangCulprit:
    time: float
    """When the newest hang event of the incident was written."""
    rank: Optional[int]
    node: str
    local_rank: int
    pid: int
    step: Optional[int]
    phase: Optional[str]
    state: str
    why: str
    nodes: int
    """Nodes that reported the incident."""

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else f"local_rank {self.local_rank}"
        at = f" at step {self.step}" if self.step is not None else ""
        return (f"{who} (node {self.node}, pid {self.pid}) stopped first{at} in phase '{self.phase or '-'}' "
                f"(process state '{self.state}'): {self.why}")


def attribute(events: Sequence[Any]) -> Optional[HangCulprit]:
    """The culprit of the newest hang incident in `events` (objects with time, node, kind, fields), or None."""
    hangs = [e for e in events if e.kind == "hang" and isinstance(e.fields.get("workers"), list)]
    if not hangs:
        return None
    newest = max(e.time for e in hangs)
    incident = [e for e in hangs if newest - e.time <= INCIDENT_S]
    workers = [(e, w) for e in incident for w in e.fields["workers"] if isinstance(w, dict)]
    if not workers:
        return None
    steps = {w.get("step") for _, w in workers}

    def key(item: tuple[Any, dict[str, Any]]) -> tuple[bool, float, float]:
        _, w = item
        step = w.get("step")
        return (w.get("state") not in CULPRIT_STATES, math.inf if step is None else step, -(w.get("silent_s") or 0))

    e, w = min(workers, key=key)
    if w.get("state") in CULPRIT_STATES:
        why = "its process was not running; the other ranks waited for it in a collective"
    elif len(steps) > 1:
        why = "it reported the lowest step; the other ranks went on into a collective it never entered"
    else:
        why = "every rank reported the same step; it was silent longest"
    return HangCulprit(time=newest, rank=w.get("rank"), node=e.node, local_rank=int(w.get("local_rank", -1)),
                       pid=int(w.get("pid", -1)), step=w.get("step"), phase=w.get("phase"),
                       state=str(w.get("state") or "unknown"), why=why, nodes=len({x.node for x in incident}))
