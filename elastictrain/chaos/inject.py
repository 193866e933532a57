"""Deterministic in-worker faults, chosen by environment: ``ELASTICTRAIN_CHAOS=crash@step=N[,rank=R]``.

The recipe calls ``maybe_inject(step, rank)`` once per step; with the variable unset it costs one dict lookup.
``crash@step=N`` makes the worker of global rank R (every rank when omitted) exit abruptly with
``CHAOS_EXIT_CODE`` when it is about to run step N, every time it gets there: a crash that restarts cannot fix,
which is what the crash-loop detection has to catch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

ENV_CHAOS = "ELASTICTRAIN_CHAOS"
CHAOS_EXIT_CODE = 13


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: Optional[int] = None
    """Global rank that fails; None: every rank."""


def parse(spec: str) -> Fault:
    """Parse ``crash@step=N[,rank=R]``; a ValueError names what was wrong."""
    kind, _, params = spec.strip().partition("@")
    if kind != "crash":
        raise ValueError(f"{ENV_CHAOS}={spec!r}: unknown fault {kind!r}; expected crash@step=N[,rank=R]")
    fields = {}
    for item in filter(None, params.split(",")):
        key, _, value = item.partition("=")
        if key not in ("step", "rank") or not value.strip().isdigit():
            raise ValueError(f"{ENV_CHAOS}={spec!r}: bad field {item!r}; expected step=N or rank=R")
        fields[key] = int(value)
    if "step" not in fields:
        raise ValueError(f"{ENV_CHAOS}={spec!r}: step=N is required")
    return Fault(kind, fields["step"], fields.get("rank"))


_cached: tuple[str, Optional[Fault]] = ("", None)


def maybe_inject(step: int, rank: int) -> None:
    """Exit this worker now if ``ELASTICTRAIN_CHAOS`` asks for a fault at (step, rank)."""
    global _cached
    spec = os.environ.get(ENV_CHAOS)
    if not spec:
        return
    if _cached[0] != spec:
        _cached = (spec, parse(spec))
    fault = _cached[1]
    assert fault is not None
    if step == fault.step and (fault.rank is None or fault.rank == rank):
        sys.stderr.write(f"elastictrain chaos: {fault.kind} at step {step} on rank {rank} ({ENV_CHAOS}={spec})\n")
        sys.stderr.flush()
        os._exit(CHAOS_EXIT_CODE)
