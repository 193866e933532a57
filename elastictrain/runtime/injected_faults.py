"""Faults a worker injects into itself, chosen by environment: ``ELASTICTRAIN_CHAOS=crash@step=N[,rank=R]`` or
``ELASTICTRAIN_CHAOS=slow@ms=M[,step=N][,rank=R][,world=W]``, or several of them separated by ``;``.

Deterministic by step and rank, unlike the chaos runner's faults (:mod:`elastictrain.chaos.schedule`), which
act on processes, nodes and services from outside the job.

The step loop (`runtime.steps`) calls ``maybe_inject(step, rank)`` once per step; with the variable unset it
costs one dict lookup.

* ``crash@step=N`` makes the worker of global rank R (every rank when omitted) exit abruptly with
  ``CHAOS_EXIT_CODE`` when it is about to run step N, every time it gets there: a crash that restarts cannot fix,
  which is what the crash-loop detection has to catch.
* ``slow@ms=M`` makes that worker sleep M ms before every step from step N on (0 when omitted): a straggler.
  Since every rank waits for the slowest in its collectives, the whole group then steps no faster than M ms, so
  tests whose faults are triggered by step numbers but last a number of seconds behave the same on a fast and on
  a busy machine. With ``world=W`` only while the group's world size is W: a survivor that trains alone slowly
  (so that a node started again comes back before the job ends) steps at full speed again once the world grew.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

ENV_CHAOS = "ELASTICTRAIN_CHAOS"
CHAOS_EXIT_CODE = 13


@dataclass(frozen=True)
class InWorkerFault:
    """A fault the worker of one rank (or every rank) injects into itself from a step on."""

    kind: str
    step: int
    rank: Optional[int] = None
    """Global rank that fails; None: every rank."""
    ms: int = 0
    """``slow``: the delay before each step."""
    world: Optional[int] = None
    """``slow``: only while the world size is this; None: whatever it is."""


_FIELDS = {"crash": ("step", "rank"), "slow": ("ms", "step", "rank", "world")}
_FORMS = "crash@step=N[,rank=R] or slow@ms=M[,step=N][,rank=R][,world=W]"


def parse_in_worker_fault(spec: str) -> InWorkerFault:
    """Parse ``crash@step=N[,rank=R]`` or ``slow@ms=M[,step=N][,rank=R][,world=W]``; a ValueError names what was
    wrong."""
    kind, _, params = spec.strip().partition("@")
    if kind not in _FIELDS:
        raise ValueError(f"{ENV_CHAOS}={spec!r}: unknown fault {kind!r}; expected {_FORMS}")
    fields = {}
    for item in filter(None, params.split(",")):
        key, _, value = item.partition("=")
        if key not in _FIELDS[kind] or not value.strip().isdigit():
            expected = " or ".join(f"{k}=N" for k in _FIELDS[kind])
            raise ValueError(f"{ENV_CHAOS}={spec!r}: bad field {item!r}; expected {expected}")
        fields[key] = int(value)
    required = "step" if kind == "crash" else "ms"
    if required not in fields:
        raise ValueError(f"{ENV_CHAOS}={spec!r}: {required}=N is required")
    return InWorkerFault(kind, fields.get("step", 0), fields.get("rank"), fields.get("ms", 0), fields.get("world"))


def parse_in_worker_faults(spec: str) -> tuple[InWorkerFault, ...]:
    """Several faults separated by ``;`` (each as `parse_in_worker_fault` reads it), all in force at once."""
    return tuple(parse_in_worker_fault(part) for part in spec.split(";") if part.strip())


_cached: tuple[str, tuple[InWorkerFault, ...]] = ("", ())


def maybe_inject(step: int, rank: int, world_size: Optional[int] = None) -> None:
    """Exit or delay this worker now if ``ELASTICTRAIN_CHAOS`` asks for a fault at (step, rank, world size)."""
    global _cached
    spec = os.environ.get(ENV_CHAOS)
    if not spec:
        return
    if _cached[0] != spec:
        _cached = (spec, parse_in_worker_faults(spec))
    for fault in _cached[1]:
        if fault.rank is not None and fault.rank != rank:
            continue
        if fault.kind == "slow":
            if step >= fault.step and fault.world in (None, world_size):
                time.sleep(fault.ms / 1000.0)
            continue
        if step == fault.step:
            sys.stderr.write(f"elastictrain chaos: {fault.kind} at step {step} on rank {rank} ({ENV_CHAOS}={spec})\n")
            sys.stderr.flush()
            os._exit(CHAOS_EXIT_CODE)
