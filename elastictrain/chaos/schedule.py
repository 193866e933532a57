"""ScheduledFault schedules: which faults to inject into a job, when, and for how long.

A schedule is a list of faults separated by ``,``, ``;`` or newlines. One fault is::

    KIND[:NODE][#RANK][@step=N | @t=SECONDS][/DURATION]

- ``KIND``: one of :data:`KINDS`.
- ``:NODE``: the node to hit (``kill-node:node1``); left out, the runner picks a live node with the schedule's
  seeded RNG when the fault fires. Only node faults (:data:`NODE_KINDS`) take a node.
- ``#RANK``: the global rank of the worker to hit (``kill-worker:node1#1``, or ``kill-worker#3``); only
  ``kill-worker`` and ``stop-worker`` take one. Left out, a seeded choice among the node's workers.
- ``@step=N``: fire once the job has completed step ``N``. ``@t=S``: fire ``S`` seconds after the schedule
  started. Neither: fire as soon as the fault before it has fired.
- ``/DURATION``: how long until the fault is healed (a stopped worker continued, a storage fault undone, a
  killed or drained node started again). Left out: the kind's default in :data:`DEFAULT_DURATIONS`.

Durations and times are seconds with an optional unit: ``10``, ``10s``, ``1.5s``, ``500ms``, ``2m``.
Examples: ``kill-worker@step=50, partition:node2@t=120s/10s``; ``stop-worker:node1#1@step=20/8s``.

Faults fire in the order they are written; see :mod:`elastictrain.chaos.runner`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

from elastictrain.errors import ConfigError

KINDS = ("kill-worker", "stop-worker", "kill-node", "drain-node", "partition", "restart-etcd",
         "storage-down", "storage-stall", "storage-readonly", "storage-full", "corrupt-checkpoint")

# Faults that hit one node (the rest hit a shared service: etcd, checkpoint storage, the checkpoints themselves).
NODE_KINDS = ("kill-worker", "stop-worker", "kill-node", "drain-node", "partition")
# Faults that hit one worker process of a node.
WORKER_KINDS = ("kill-worker", "stop-worker")
# Faults with nothing to undo: the job itself must recover (restart the worker, fall back to an older checkpoint).
UNHEALED_KINDS = ("kill-worker", "corrupt-checkpoint")

# Seconds until a fault is healed when the schedule gives no ``/DURATION``; None: nothing to heal.
DEFAULT_DURATIONS: dict[str, Optional[float]] = {
    "kill-worker": None,
    "stop-worker": 10.0,
    "kill-node": 5.0,
    "drain-node": 5.0,
    "partition": 10.0,
    "restart-etcd": 3.0,
    "storage-down": 10.0,
    "storage-stall": 10.0,
    "storage-readonly": 15.0,
    "storage-full": 15.0,
    "corrupt-checkpoint": None,
}

GRAMMAR = "KIND[:NODE][#RANK][@step=N|@t=SECONDS][/DURATION], e.g. 'kill-worker@step=50, partition:node2@t=120s/10s'"

_FAULT_RE = re.compile(
    r"""^(?P<kind>[a-z][a-z-]*)
        (?::(?P<target>[A-Za-z0-9_.\-]+))?
        (?:\#(?P<rank>\d+))?
        (?:@(?:step=(?P<step>\d+)|t=(?P<time>[0-9.e+-]+(?:ms|s|m)?)))?
        (?:/(?P<duration>[0-9.e+-]+(?:ms|s|m)?))?$""",
    re.VERBOSE,
)
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "": 1.0}


def _seconds(text: str, token: str) -> float:
    """Parse '10', '10s', '1.5s', '500ms' or '2m' into seconds."""
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)(ms|s|m)?", text)
    if not m:
        raise ConfigError(f"chaos schedule: bad time {text!r} in {token!r}; write seconds like '10s' ({GRAMMAR})")
    return float(m.group(1)) * _UNIT[m.group(2) or ""]


def _fmt_seconds(x: float) -> str:
    """Seconds as the shortest text that parses back to the same float ('120s', '0.5s')."""
    text = repr(float(x))
    return (text[:-2] if text.endswith(".0") else text) + "s"


@dataclass(frozen=True)
class ScheduledFault:
    """One fault to inject: what, where, when, and for how long."""

    kind: str
    target: Optional[str] = None
    rank: Optional[int] = None
    at_step: Optional[int] = None
    at_time: Optional[float] = None
    duration: Optional[float] = None

    def __post_init__(self) -> None:
        what = self.describe_unchecked()
        if self.kind not in KINDS:
            raise ConfigError(f"chaos schedule: unknown fault kind {self.kind!r} in {what!r}; "
                              f"use one of {', '.join(KINDS)}")
        if self.target is not None and self.kind not in NODE_KINDS:
            raise ConfigError(f"chaos schedule: {self.kind} hits no node; drop ':{self.target}' from {what!r}")
        if self.rank is not None and self.kind not in WORKER_KINDS:
            raise ConfigError(f"chaos schedule: only {' and '.join(WORKER_KINDS)} take a rank; "
                              f"drop '#{self.rank}' from {what!r}")
        if self.at_step is not None and self.at_time is not None:
            raise ConfigError(f"chaos schedule: {what!r} has both @step and @t; give one")
        if self.at_step is not None and self.at_step < 0 or self.at_time is not None and self.at_time < 0:
            raise ConfigError(f"chaos schedule: {what!r} fires at a negative step or time")
        if self.duration is not None:
            if self.kind in UNHEALED_KINDS:
                raise ConfigError(f"chaos schedule: {self.kind} has nothing to heal; drop the /duration from {what!r}")
            if self.duration < 0:
                raise ConfigError(f"chaos schedule: {what!r} has a negative duration")

    @property
    def heal_after(self) -> Optional[float]:
        """Seconds from firing until the fault is healed: the given duration, else the kind's default."""
        return self.duration if self.duration is not None else DEFAULT_DURATIONS[self.kind]

    def describe(self) -> str:
        """The fault in schedule grammar, e.g. 'partition:node2@t=120s/10s'; parses back to an equal ScheduledFault."""
        return self.describe_unchecked()

    def describe_unchecked(self) -> str:
        """describe() without assuming the fields are valid (used while validating them)."""
        out = self.kind
        if self.target is not None:
            out += f":{self.target}"
        if self.rank is not None:
            out += f"#{self.rank}"
        if self.at_step is not None:
            out += f"@step={self.at_step}"
        elif self.at_time is not None:
            out += f"@t={_fmt_seconds(self.at_time)}"
        if self.duration is not None:
            out += f"/{_fmt_seconds(self.duration)}"
        return out

    @classmethod
    def parse(cls, token: str) -> "ScheduledFault":
        """Parse one fault, e.g. 'kill-worker:node1#1@step=40'; ConfigError names the bad token."""
        text = token.strip()
        m = _FAULT_RE.match(text)
        if not m:
            raise ConfigError(f"chaos schedule: cannot parse {text!r}; a fault is {GRAMMAR}")
        kind = m.group("kind")
        if kind not in KINDS:
            raise ConfigError(f"chaos schedule: unknown fault kind {kind!r} in {text!r}; use one of {', '.join(KINDS)}")
        return cls(
            kind=kind,
            target=m.group("target"),
            rank=int(m.group("rank")) if m.group("rank") is not None else None,
            at_step=int(m.group("step")) if m.group("step") is not None else None,
            at_time=_seconds(m.group("time"), text) if m.group("time") is not None else None,
            duration=_seconds(m.group("duration"), text) if m.group("duration") is not None else None,
        )


@dataclass
class Schedule:
    """An ordered list of faults plus the seed of the RNG that picks unnamed nodes and ranks."""

    faults: list[ScheduledFault] = field(default_factory=list)
    seed: int = 0

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> "Schedule":
        """Parse faults separated by ',', ';' or newlines (grammar in the module docstring)."""
        tokens = [t.strip() for t in re.split(r"[,;\n]", text)]
        faults = [ScheduledFault.parse(t) for t in tokens if t]
        if not faults:
            raise ConfigError(f"chaos schedule: {text!r} holds no fault; write faults as {GRAMMAR}")
        return cls(faults=faults, seed=seed)

    @classmethod
    def random(cls, seed: int, count: int, *, kinds: Sequence[str] = KINDS, start_s: float = 10.0,
               every_s: float = 15.0, jitter: float = 0.3) -> "Schedule":
        """`count` faults of seeded-random kinds, about every `every_s` seconds from `start_s` on.

        Each fault fires at ``start_s + i * every_s``, moved by up to ``jitter * every_s`` either way (rounded to
        0.1 s), with its kind's default duration. Nodes and ranks are left to the runner's RNG (seeded the same).
        """
        if count < 0:
            raise ConfigError(f"chaos schedule: a random schedule needs count >= 0, got {count}")
        if not kinds:
            raise ConfigError("chaos schedule: a random schedule needs at least one fault kind")
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise ConfigError(f"chaos schedule: unknown fault kinds {unknown}; use some of {', '.join(KINDS)}")
        if not 0.0 <= jitter < 0.5:
            raise ConfigError(f"chaos schedule: jitter must be in [0, 0.5) so faults keep their order, got {jitter}")
        rng = random.Random(seed)
        faults = []
        for i in range(count):
            kind = rng.choice(list(kinds))
            at = start_s + i * every_s + rng.uniform(-jitter, jitter) * every_s
            faults.append(ScheduledFault(kind=kind, at_time=round(max(at, 0.0), 1)))
        return cls(faults=faults, seed=seed)

    def describe(self) -> str:
        """The whole schedule in grammar form; Schedule.parse(describe(), seed) gives it back."""
        return ", ".join(f.describe() for f in self.faults)
