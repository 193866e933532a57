"""How often to snapshot (`checkpoint.snapshot_every_steps: auto`): every step when that costs training at most 5%,
else the smallest interval that keeps the cost under that.

What a snapshot costs a step depends on the model, the host and what else runs on it: on a GPU node the copy is a
DMA that overlaps the next step, on a CPU node its copy thread and checksum take cores from training, and so does
the agent's replication of each snapshot to the peer node (measured here at 150M parameters: steps 1.34x stock). So
the interval is measured, not guessed. For its first `probe_steps` steps the pacer alternates blocks of `BLOCK`
steps with a snapshot after each and blocks without any. The time from one step boundary to the next after a
snapshot (the copy of what the optimizer does not change, the next step, which the copy thread and the replica of
the snapshot before compete with, and the wait for that copy in the optimizer's pre-hook), against the same after a
step without one, gives the cost of a snapshot, `c`, and the plain step time `s`. Only steps whose boundary before
was of the same kind count: the first step without a snapshot still carries the replica of the last one, which is
sent after the copy commits (alternating single steps, as the probe did before, counted that replica as the plain
step's: in a 2-node job at 150M it measured 0.97 s per snapshot against the block probe's 2.06 s, and picked every
3rd step instead of every 7th; benchmarks/snapshot_pace.py). The interval is the smallest n with
c / (n s) <= target, at most `max_interval`. Every rank measures; the ranks take the largest interval (one small
all_reduce, once), so that they snapshot the same steps (the blocks are numbered by step, the same on every rank).

A group re-formed in place (a worker replaced, `elastic.in_place`) keeps the interval its survivors decided: the
checkpointer is new, but the process remembers the pace it decided (`remember`, per run, config and world size) and
the new group's ranks agree on it at their first step (one more small all_reduce; a replacement knows none, the
survivors' count), instead of probing again for 18 steps, during which a crash could recompute up to 3 steps. A
world of another size, or a restart (new processes), probes again.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

TARGET_COST = 0.05
"""The most a snapshot may cost training, as a fraction of the step time (issue #14's target)."""
PROBE_STEPS = 18
BLOCK = 3
"""Steps per probe block: the first step of a block carries the last one's work, the other two are counted."""
MAX_INTERVAL = 100

_remembered: dict[tuple, "Pace"] = {}
"""The pace this process decided or adopted, per (run, config fingerprint, world size): for the next group."""


def remember(key: tuple, pace: "Pace") -> None:
    _remembered[key] = pace


def remembered(key: tuple) -> Optional["Pace"]:
    return _remembered.get(key)


@dataclass(frozen=True)
class Pace:
    """The interval chosen, and the measurement behind it."""

    interval: int
    cost_s: float
    """What one snapshot adds to the step boundary-to-boundary time (median over the probe)."""
    step_s: float
    """A step without a snapshot (median over the probe)."""

    @property
    def overhead(self) -> float:
        """The cost at the chosen interval, as a fraction of the step time."""
        return max(self.cost_s, 0.0) / (self.interval * self.step_s) if self.step_s > 0 else 0.0


def interval_for(cost_s: float, step_s: float, target: float = TARGET_COST, most: int = MAX_INTERVAL) -> int:
    """The smallest interval whose snapshots cost at most `target` of the step time."""
    if cost_s <= 0 or step_s <= 0:
        return 1
    return max(1, min(most, math.ceil(cost_s / (target * step_s) - 1e-9)))


class SnapshotPacer:
    """Says which steps to snapshot: `due(step)` at each step boundary; fixed, or measured first (`auto`)."""

    def __init__(self, every: int | str, agree: Callable[[int], int], probe_steps: int = PROBE_STEPS,
                 target: float = TARGET_COST, clock: Callable[[], float] = time.monotonic,
                 carried: Optional[Pace] = None):
        """`every`: an interval, or "auto"; `agree(n)`: the largest `n` over the ranks (a collective); `carried`:
        with "auto", the pace this process decided in the group before (see the module's docstring)."""
        self.auto = every == "auto"
        self._carried = carried
        self.carried_over = False
        """The interval was agreed from the group before's, not measured by this group."""
        self._checked_carry = not self.auto
        self.interval: int = 0 if self.auto else int(every)
        """The steps between snapshots; with `auto`, 0 until the probe decided (it snapshots in blocks meanwhile)."""
        self.pace: Optional[Pace] = None
        self._agree, self._probe_steps, self._target, self._clock = agree, probe_steps, target, clock
        self._last: Optional[tuple[float, bool]] = None
        """The last boundary's time and whether it snapshotted."""
        self._kind_before: Optional[bool] = None
        """Whether the boundary before that one snapshotted."""
        self._after: dict[bool, list[float]] = {True: [], False: []}
        self._seen = 0

    def due(self, step: int, also: bool = False) -> bool:
        """Whether to snapshot at this step boundary (the same answer on every rank); call once per step, on every
        rank. `also`: snapshot anyway (a durable save is due, and is written from the snapshot)."""
        now = self._clock()
        if not self._checked_carry:  # the first boundary, on every rank: one collective
            self._checked_carry = True
            agreed = self._agree(self._carried.interval if self._carried is not None else 0)
            if agreed > 0:
                kept = self._carried or Pace(agreed, 0.0, 0.0)
                self.interval, self.pace, self.carried_over = agreed, Pace(agreed, kept.cost_s, kept.step_s), True
        probing = self.auto and self.pace is None
        if probing:
            if self._last is not None and self._kind_before == self._last[1]:
                self._after[self._last[1]].append(now - self._last[0])
            self._seen += 1
            if self._seen > self._probe_steps:
                self._decide()
                probing = False
        if probing:
            snapshot = also or (step // BLOCK) % 2 == 1
        else:
            snapshot = also or (self.interval > 0 and step % self.interval == 0)
        self._kind_before = self._last[1] if self._last is not None else None
        self._last = (now, snapshot)
        return snapshot

    def _decide(self) -> None:
        after, plain = self._after[True], self._after[False]
        step_s = statistics.median(plain) if plain else 0.0
        cost_s = statistics.median(after) - step_s if after and plain else 0.0
        mine = interval_for(cost_s, step_s, self._target)
        self.interval = self._agree(mine)
        self.pace = Pace(self.interval, cost_s, step_s)
