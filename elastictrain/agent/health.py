"""Worker health: last heartbeat per local worker, and the hang rule. Pure logic; the caller passes the clock.

Rule: a running worker is hung when it has made no progress for longer than the timeout of its phase:
  - never beat since it started:          ``startup_timeout_s``, only when ``expect_beats`` or once any worker of
                                          this monitor has beaten (a user's script that never beats is never
                                          judged; its exits are seen by the agent's worker monitor all the same)
  - train, calibrated (enough step times): ``max(hang_floor_s, step_time_multiplier x p99 step time,
                                          longest_step_factor x the longest step seen)``
  - train, not yet calibrated, after a restart at the same world size: twice the previous group's calibrated
                                          timeout (its calibration outlives the workers; the first steps of a new
                                          process are slower)
  - train, 5 to 19 step times so far:      ``max(floor, 3 x 5 x their median, 1.5 x the longest)``
  - train, not yet calibrated otherwise:  ``warmup_timeout_s`` (first steps may compile, warm caches)
  - init / load / save / paused / done:   their own allowance (never below the floor)
  - a user section (``Worker.section``):  its declared timeout; else ``step_time_multiplier`` x its longest run
                                          on this node once it ran ``SECTION_CALIBRATION_RUNS`` times; else the init
                                          allowance
Progress in ``train`` means a higher step; in the other phases any beat counts, since they do not advance steps.
Step times are (time, step) deltas between consecutive train beats, pooled over the node's workers
(they step in lockstep), leaving out each worker's first step of a group (page faults, first snapshot), and
re-calibrated with every new worker group (the world size, hence step time, may change).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from elastictrain.config import HangConfig
from elastictrain.errors import ConfigError
from elastictrain.runtime.heartbeat import SECTION_PREFIX, Beat

_HANG = HangConfig()  # the documented defaults live in elastictrain.config
SECTION_CALIBRATION_RUNS = 3
"""Runs of a user section before its own durations set its timeout."""


@dataclass(frozen=True)
class HealthConfig:
    """Hang detection settings; the defaults are the config's (`elastic.hang`, docs/agent.md)."""

    enabled: bool = True
    hang_floor_s: float = _HANG.floor_s
    step_time_multiplier: float = _HANG.step_time_multiplier
    step_time_quantile: float = 0.99
    calibration_min_steps: int = 20
    """Step times needed before the calibrated timeout applies: enough that a periodic slow step (an eval, a
    save's staging every 10 steps) is among them."""
    provisional_min_steps: int = 5
    """From this many step times until `calibration_min_steps`: `provisional_factor` x the multiplier x their median
    (and 1.5 x the longest)."""
    provisional_factor: float = 3.0
    longest_step_factor: float = 1.5
    """The timeout stays above this multiple of the longest step seen, however rare (slower than the quantile)."""
    calibration_window: int = 200
    startup_timeout_s: float = _HANG.startup_timeout_s
    expect_beats: bool = True
    """Hold a worker that never beat to ``startup_timeout_s`` from its start; False: only once a worker beat."""
    warmup_timeout_s: float = _HANG.warmup_timeout_s
    init_timeout_s: float = _HANG.init_timeout_s
    load_timeout_s: float = _HANG.load_timeout_s
    save_timeout_s: float = _HANG.save_timeout_s
    paused_timeout_s: float = _HANG.init_timeout_s
    done_timeout_s: float = _HANG.done_timeout_s

    @classmethod
    def from_hang(cls, hang: HangConfig, expect_beats: bool) -> "HealthConfig":
        """The agent's settings from the config's `elastic.hang` (floor 0: hang detection off)."""
        return cls(enabled=hang.floor_s > 0, hang_floor_s=hang.floor_s or _HANG.floor_s,
                   step_time_multiplier=hang.step_time_multiplier, startup_timeout_s=hang.startup_timeout_s,
                   expect_beats=expect_beats, warmup_timeout_s=hang.warmup_timeout_s,
                   init_timeout_s=hang.init_timeout_s, paused_timeout_s=hang.init_timeout_s,
                   load_timeout_s=hang.load_timeout_s, save_timeout_s=hang.save_timeout_s,
                   done_timeout_s=hang.done_timeout_s)

    def __post_init__(self) -> None:
        for name in ("hang_floor_s", "step_time_multiplier", "startup_timeout_s", "warmup_timeout_s",
                     "init_timeout_s", "load_timeout_s", "save_timeout_s", "paused_timeout_s",
                     "done_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"health.{name} must be > 0, got {getattr(self, name)}; "
                                  "to turn hang detection off set enabled=False (--heartbeat-timeout 0)")
        if not 0 < self.step_time_quantile <= 1:
            raise ConfigError(f"health.step_time_quantile must be in (0, 1], got {self.step_time_quantile}")
        if self.calibration_min_steps < 1 or self.calibration_window < self.calibration_min_steps:
            raise ConfigError("health.calibration_window must be >= calibration_min_steps >= 1, got "
                              f"{self.calibration_window} and {self.calibration_min_steps}")


@dataclass
class WorkerHealth:
    """What the agent knows about one local worker in the current group."""

    local_rank: int
    pid: int
    started: float
    step: int | None = None
    phase: str | None = None
    last_beat: float | None = None
    last_progress: float | None = None
    # worker-clock time and step of the previous train beat, the baseline of the next step-time sample
    train_mark: tuple[float, int] | None = None
    first_step: int | None = None
    """The step of its first train beat: where this group resumed (the restart policy judges progress by it)."""
    first_step_at: float | None = None
    """When its first train beat was received (agent clock)."""
    sampled: bool = False
    """Its first step time of this group was seen (and left out of the calibration)."""
    section_entered: float | None = None
    """When it entered the user section it is in (agent clock)."""


@dataclass(frozen=True)
class Hang:
    """A worker judged hung: enough to say what happened and to act on it."""

    local_rank: int
    pid: int
    phase: str | None
    step: int | None
    silent_s: float
    timeout_s: float
    rule: str

    def describe(self) -> str:
        if self.phase is None:
            return (f"local_rank {self.local_rank} (pid {self.pid}) sent no heartbeat within {self.silent_s:.1f}s "
                    f"of starting ({self.rule})")
        return (f"local_rank {self.local_rank} (pid {self.pid}) made no progress for {self.silent_s:.1f}s "
                f"in phase '{self.phase}' at step {self.step} ({self.rule})")


@dataclass
class HealthMonitor:
    """Tracks heartbeats of the current worker group and judges hangs at a given time."""

    config: HealthConfig = field(default_factory=HealthConfig)
    workers: dict[int, WorkerHealth] = field(default_factory=dict)
    beats_seen: bool = False
    """Some worker of this monitor (any group so far) has sent a beat: its workers do use heartbeats."""
    _step_times: deque[float] = field(init=False)
    _longest: float = 0.0
    _world_size: int = 0
    _prior: tuple[int, float] | None = None
    """(world size, calibrated train timeout) of the last group that calibrated."""
    _sections: dict[str, deque[float]] = field(default_factory=dict)
    """User section phase -> its durations on this node (kept across groups of the same world size)."""
    _section_decl: dict[str, tuple[str, float | None]] = field(default_factory=dict)
    """User section phase -> (name, declared timeout), from the workers' `section_declared` events."""

    def __post_init__(self) -> None:
        self._step_times = deque(maxlen=self.config.calibration_window)

    def reset(self, pids: Mapping[int, int], now: float, world_size: int = 0) -> None:
        """Start watching a new worker group (local_rank -> pid) of ``world_size`` ranks, started at ``now``."""
        if self.step_time() is not None:
            self._prior = (self._world_size, self.timeout_for("train")[0])
        self.workers = {lr: WorkerHealth(local_rank=lr, pid=pid, started=now) for lr, pid in pids.items()}
        if world_size != self._world_size:
            self._sections.clear()
        self._step_times.clear()
        self._longest, self._world_size = 0.0, world_size

    def rebase(self, now: float) -> None:
        """Restart every worker's silence clock at ``now``: the watcher itself was held up and missed beats."""
        for w in self.workers.values():
            if w.last_progress is None:
                w.started = max(w.started, now)
            else:
                w.last_progress = max(w.last_progress, now)

    def record(self, beat: Beat, now: float) -> bool:
        """Take one beat received at ``now``; False when it is not from a current worker (stale, foreign)."""
        w = self.workers.get(beat.local_rank)
        if w is None or w.pid != beat.pid:
            return False
        self.beats_seen = True
        if beat.phase == "train":
            if w.first_step is None:
                w.first_step, w.first_step_at = beat.step, now
            progressed = w.phase != "train" or w.step is None or beat.step > w.step
            mark = w.train_mark
            if mark is None or beat.step > mark[1]:
                if mark is not None and beat.time >= mark[0]:
                    if w.sampled:
                        sample = (beat.time - mark[0]) / (beat.step - mark[1])
                        self._step_times.append(sample)
                        self._longest = max(self._longest, sample)
                    w.sampled = True
                w.train_mark = (beat.time, beat.step)
        else:
            # a new train baseline after any other phase: a save or load is not a step
            progressed = True
            w.train_mark = None
        if beat.phase != w.phase:
            self._section_change(w, beat.phase, now)
        w.phase, w.step, w.last_beat = beat.phase, beat.step, now
        if progressed:
            w.last_progress = now
        return True

    def _section_change(self, w: WorkerHealth, phase: str, now: float) -> None:
        """A worker left or entered a user section: the run just ended is one sample of that section's duration."""
        if w.phase is not None and w.phase.startswith(SECTION_PREFIX) and w.section_entered is not None:
            runs = self._sections.setdefault(w.phase, deque(maxlen=self.config.calibration_window))
            runs.append(now - w.section_entered)
        w.section_entered = now if phase.startswith(SECTION_PREFIX) else None

    def adopt_calibration(self, world_size: int, step_time_s: float) -> None:
        """Another node's calibrated step time for groups of `world_size` ranks (read from etcd when this agent
        started): the prior of this agent's first group, so a re-started node is not held to the warm-up allowance.
        This agent's own calibration, once it has one, wins."""
        if self._prior is None and world_size > 0 and step_time_s > 0:
            c = self.config
            self._prior = (world_size, max(c.hang_floor_s, c.step_time_multiplier * step_time_s))

    def declare_section(self, phase: str, name: str, timeout_s: float | None) -> None:
        """A worker named a section (`section_declared`): its name for messages, and its timeout if it set one."""
        self._section_decl[phase] = (name, timeout_s)

    def phase_name(self, phase: str | None) -> str | None:
        """A phase as operators read it: `section:eval` rather than the wire's `section:0`."""
        if phase is not None and phase in self._section_decl:
            return f"{SECTION_PREFIX}{self._section_decl[phase][0]}"
        return phase

    def _section_timeout(self, phase: str) -> tuple[float, str]:
        c = self.config
        name, declared = self._section_decl.get(phase, (phase, None))
        if declared is not None:
            t = max(c.hang_floor_s, declared)
            return t, f"section '{name}' timeout {t:g}s (declared)"
        runs = self._sections.get(phase, ())
        if len(runs) >= SECTION_CALIBRATION_RUNS:
            t = max(c.hang_floor_s, c.step_time_multiplier * max(runs))
            return t, (f"section '{name}' timeout {t:.1f}s = max(floor {c.hang_floor_s:g}s, "
                       f"{c.step_time_multiplier:g} x its longest of {len(runs)} runs {max(runs):.3f}s)")
        t = max(c.hang_floor_s, c.init_timeout_s)
        return t, f"section '{name}' allowance {t:g}s ({len(runs)} runs seen, {SECTION_CALIBRATION_RUNS} calibrate it)"

    def started_up(self, now: float, silent_startup_s: float) -> bool:
        """Every worker reported a step past its first train beat: start-up, load and the group's first step are over.

        The first train beat comes once the state is loaded, before the first step, which is still the heaviest
        (first forward, allocations, the optimizer's state). Workers that send no heartbeats (a user script without
        our API) never report one: theirs is taken as over `silent_startup_s` after they started.
        """
        if not self.workers:
            return False
        if not (self.config.expect_beats or self.beats_seen):
            return all(now - w.started > silent_startup_s for w in self.workers.values())
        return all(w.first_step is not None and w.step is not None and w.step > w.first_step
                   for w in self.workers.values())

    def finishing(self) -> bool:
        """Some worker left its training loop (phase "done"): the group is ending."""
        return any(w.phase == "done" for w in self.workers.values())

    def seconds_left(self, total_steps: int) -> float | None:
        """Time to `total_steps` at the pace of this group since its first train beat; None until it made a step."""
        paces = [((w.last_beat - w.first_step_at) / (w.step - w.first_step), w.step) for w in self.workers.values()
                 if w.first_step is not None and w.first_step_at is not None and w.last_beat is not None
                 and w.step is not None and w.step > w.first_step]
        if not paces:
            return None
        pace, step = min(paces, key=lambda p: p[1])
        return max(0, total_steps - step) * pace

    def _pace(self, min_steps: int) -> float | None:
        """The mean time per step since the first train beat of the slowest worker that is `min_steps` past it;
        None while none is."""
        paces = [(w.last_beat - w.first_step_at) / (w.step - w.first_step) for w in self.workers.values()
                 if w.first_step is not None and w.first_step_at is not None and w.last_beat is not None
                 and w.step is not None and w.step - w.first_step >= min_steps]
        return max(paces) if paces else None

    def step_time(self) -> float | None:
        """The calibrating quantile of observed step times, or None until enough steps were seen."""
        if len(self._step_times) < self.config.calibration_min_steps:
            return None
        ordered = sorted(self._step_times)
        return ordered[max(0, math.ceil(self.config.step_time_quantile * len(ordered)) - 1)]

    def timeout_for(self, phase: str | None) -> tuple[float, str]:
        """The hang timeout for a worker in ``phase`` (None: not yet beaten) and the rule that set it."""
        c = self.config
        if phase is None:
            return c.startup_timeout_s, f"startup allowance {c.startup_timeout_s:g}s"
        if phase == "train":
            st = self.step_time()
            if st is None:
                if self._prior is not None and self._world_size and self._prior[0] == self._world_size:
                    t = max(c.hang_floor_s, 2 * self._prior[1])
                    return t, (f"2 x the previous group's calibrated timeout {self._prior[1]:.1f}s, until this group "
                               f"calibrates")
                enough = len(self._step_times) >= c.provisional_min_steps
                pace = None if enough else self._pace(c.provisional_min_steps)
                if enough or pace is not None:
                    # Few samples: their median (the max would be the slowest early step, and 15 x that let a
                    # worker stopped at step 8 go unnoticed for 20 s), with the longest still kept above. Fewer
                    # samples than steps (beats are rate-limited: a group of 30 ms steps sends one every few steps,
                    # and a save's beat starts a new baseline): the mean pace since the first train beat, saves
                    # included. Seen: a restarted group stopped 0.4 s into training held to the 600 s warm-up.
                    typical = statistics.median(self._step_times) if enough else pace
                    assert typical is not None
                    what = "median step time" if enough else "mean step time since the first train beat"
                    t = max(c.hang_floor_s, c.provisional_factor * c.step_time_multiplier * typical,
                            c.longest_step_factor * self._longest)
                    return t, (f"provisional timeout {t:.1f}s = max(floor {c.hang_floor_s:g}s, "
                               f"{c.provisional_factor:g} x {c.step_time_multiplier:g} x {what} "
                               f"{typical:.3f}s, {c.longest_step_factor:g} x longest step {self._longest:.3f}s) over "
                               f"{len(self._step_times)} samples, until {c.calibration_min_steps} calibrate it")
                t = max(c.hang_floor_s, c.warmup_timeout_s)
                return t, f"warm-up allowance {t:g}s, step time not calibrated yet"
            t = max(c.hang_floor_s, c.step_time_multiplier * st, c.longest_step_factor * self._longest)
            return t, (f"timeout {t:.1f}s = max(floor {c.hang_floor_s:g}s, "
                       f"{c.step_time_multiplier:g} x p{round(c.step_time_quantile * 100)} step time {st:.3f}s, "
                       f"{c.longest_step_factor:g} x longest step {self._longest:.3f}s)")
        if phase.startswith(SECTION_PREFIX):
            return self._section_timeout(phase)
        allowance = {"init": c.init_timeout_s, "load": c.load_timeout_s, "save": c.save_timeout_s,
                     "paused": c.paused_timeout_s, "done": c.done_timeout_s}[phase]
        t = max(c.hang_floor_s, allowance)
        return t, f"{phase} allowance {t:g}s"

    def check(self, now: float, running: set[int] | None = None) -> list[Hang]:
        """Hung workers at ``now`` among the local ranks in ``running`` (default: all), likely culprit first."""
        if not self.config.enabled:
            return []
        hangs = []
        for lr, w in self.workers.items():
            if running is not None and lr not in running:
                continue
            if w.phase is None and not (self.config.expect_beats or self.beats_seen):
                continue  # a script that does not use our worker API never beats: only its exit says anything
            since = w.started if w.last_progress is None else w.last_progress
            timeout, rule = self.timeout_for(w.phase)
            silent = now - since
            if silent > timeout:
                hangs.append(Hang(local_rank=lr, pid=w.pid, phase=w.phase, step=w.step, silent_s=silent,
                                  timeout_s=timeout, rule=rule))
        # Likely culprit first: in a stuck collective the peers wait one step ahead of the rank that stalled.
        hangs.sort(key=lambda h: (h.step is not None, h.step or 0, -h.silent_s, h.local_rank))
        return hangs
