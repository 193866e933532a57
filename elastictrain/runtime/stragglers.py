"""Stragglers: ranks that are alive but slower than the others, named from each step's timing.

Each rank measures, per step, two things the step loop's one all_reduce already carries to every rank:

- ``prelude``: from the end of the previous step (every rank leaves that all_reduce together) to its model's first
  forward call, the step's first collective under FSDP: data loading, host-side work, the chaos ``slow@`` fault.
  A rank late here makes the others wait inside their first all-gather, where nothing of ours can see it.
- ``busy``: from the end of the previous step to entering this step's all_reduce. Every rank waits for the slowest
  in the model's collectives, so ranks differ here by what they do after the last one (optimizer step, clipping):
  a rank whose compute is slow arrives last.

A rank's lateness is ``(prelude - typical prelude) + (busy - typical busy)``, where typical is the lower quartile
over the ranks (the faster of two; robust to a few fast outliers in a big group): about 0 for every rank in a
healthy group, the straggler's extra time for a slow one. It is reported as a straggler once its lateness exceeds
``margin`` x the median step time (and ``min_lateness_s``) for ``steps`` steps in a row, and cleared once it stays
below half that margin for as long. With ``confirm_steps`` set (the agent's ``elastic.replace_stragglers``), a
named rank that stays above the full margin for that many further steps in a row is *confirmed*, once per naming:
the agent may then replace it. Pure logic: `StepLoop` feeds it and reports the changes.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

MAX_WORLD = 1024
"""Above this many ranks the per-rank timings are not exchanged (2 floats per rank in every step's all_reduce)."""

ENV_CONFIRM_STEPS = "ELASTICTRAIN_STRAGGLER_CONFIRM_STEPS"
"""Set by the agent when it replaces stragglers (`elastic.straggler_replace_after_steps`): `confirm_steps`."""
ENV_MARGIN = "ELASTICTRAIN_STRAGGLER_MARGIN"
"""Set by the agent: `elastic.straggler_margin`."""
ENV_STEPS = "ELASTICTRAIN_STRAGGLER_STEPS"
"""Set by the agent: `elastic.straggler_steps`."""


@dataclass(frozen=True)
class StragglerConfig:
    margin: float = 0.2
    """Lateness, as a fraction of the median step time, that makes a rank slow."""
    steps: int = 20
    """Consecutive slow steps before a rank is named (and fast ones before it is cleared)."""
    min_lateness_s: float = 0.02
    """Below this a rank is never slow (timer noise on very short steps)."""
    confirm_steps: int = 0
    """Steps in a row a named rank must stay slow before it is confirmed (0: never confirmed)."""


def _env_number(name: str, kind: type, default: Any, low: float) -> Any:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or value < low:
        log.warning("ignoring %s=%r: not a number >= %g; using %s", name, raw, low, default)
        return default
    return value


def config_from_env() -> "StragglerConfig":
    """The defaults, with what the agent set in the environment (its `elastic.straggler_*` settings)."""
    d = StragglerConfig()
    return StragglerConfig(margin=_env_number(ENV_MARGIN, float, d.margin, 1e-9),
                           steps=_env_number(ENV_STEPS, int, d.steps, 1),
                           confirm_steps=_env_number(ENV_CONFIRM_STEPS, int, 0, 0))


@dataclass(frozen=True)
class Change:
    """A rank became a straggler (`slow`) or stopped being one, at `step`."""

    rank: int
    slow: bool
    step: int
    lateness_s: float
    """Median lateness over the steps that decided it."""
    score: float
    """That lateness over the median step time."""
    confirmed: bool = False
    """A named rank stayed slow for `StragglerConfig.confirm_steps` more steps (`slow` is then True too)."""


@dataclass
class StragglerWatch:
    world_size: int
    config: StragglerConfig = field(default_factory=StragglerConfig)
    slow: dict[int, Change] = field(default_factory=dict)
    """The ranks named slow now, with the change that named them."""
    _runs: dict[int, list[float]] = field(default_factory=dict)
    _confirm_runs: dict[int, list[float]] = field(default_factory=dict)
    """Named ranks not yet confirmed -> their lateness over the slow steps in a row since they were named."""
    _step_times: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self._step_times = deque(maxlen=self.config.steps * 5)

    def observe(self, step: int, prelude: list[float], busy: list[float], step_time: float) -> list[Change]:
        """Take one step's per-rank timings (seconds) and its duration; the ranks whose state changed."""
        c = self.config
        self._step_times.append(step_time)
        typical = statistics.median(self._step_times)
        mid_prelude, mid_busy = _lower_quartile(prelude), _lower_quartile(busy)
        changes = []
        for rank in range(self.world_size):
            late = (prelude[rank] - mid_prelude) + (busy[rank] - mid_busy)
            is_slow = rank in self.slow
            limit = c.margin * typical / (2 if is_slow else 1)
            flips = late < limit if is_slow else late > max(limit, c.min_lateness_s)
            if is_slow:
                changes += self._confirm(rank, step, late, typical)
            run = self._runs.setdefault(rank, [])
            if not flips:
                run.clear()
                continue
            run.append(late)
            if len(run) < c.steps:
                continue
            lateness = statistics.median(run)
            change = Change(rank=rank, slow=not is_slow, step=step, lateness_s=lateness,
                            score=lateness / typical if typical > 0 else 0.0)
            if change.slow:
                self.slow[rank] = change
                if c.confirm_steps:
                    self._confirm_runs[rank] = []
            else:
                self.slow.pop(rank, None)
                self._confirm_runs.pop(rank, None)
            run.clear()
            changes.append(change)
        return changes

    def _confirm(self, rank: int, step: int, late: float, typical: float) -> list[Change]:
        """A named rank's confirmation: the full margin (not the clearing half) exceeded `confirm_steps` in a row."""
        run = self._confirm_runs.get(rank)
        if run is None:  # confirmation off, or this naming was confirmed already
            return []
        if late <= max(self.config.margin * typical, self.config.min_lateness_s):
            run.clear()
            return []
        run.append(late)
        if len(run) < self.config.confirm_steps:
            return []
        del self._confirm_runs[rank]
        lateness = statistics.median(run)
        return [Change(rank=rank, slow=True, step=step, lateness_s=lateness,
                       score=lateness / typical if typical > 0 else 0.0, confirmed=True)]


def _lower_quartile(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 4]
