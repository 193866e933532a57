"""The job-wide restart policy, kept in etcd (not per agent: pytorch#108158): budget, backoff, when to give up.

One failure makes every agent of the group restart (its own worker died, or a collective on a dead peer
failed), so a restart is charged per *rendezvous round*: the first agent to record `restarts/<round>` charges
it, the others find it there. Every rule below reads those shared records, so all agents decide alike:

- budget: the number of records may not exceed `max_restarts`;
- crash loop: `crash_loop_restarts` restarts in a row that all failed at the same step, give or take
  `CRASH_LOOP_STEP_SLACK` (or before any step);
- no progress: `max_no_progress_restarts` restarts in a row whose group committed no checkpoint newer than the
  one it resumed from (NVRx's max_no_progress_cycles): failures at scattered steps inside one checkpoint interval;
- backoff: the k-th restart of such a streak waits `backoff_s * 2**(k-2)` (at most `backoff_max_s`, with
  +-`backoff_jitter` drawn from the run and round, so that every agent of a job waits alike while jobs that fail
  together spread out); the first restart of a streak is immediate;
- fatal: a worker that exits with `EXIT_FATAL` (bad config or input, an incompatible checkpoint) ends the job
  at once; its one-line cause is kept in `fatal`, so every node, `elastictrain status` and the event log say why.

Progress needs the newest committed checkpoint step: agents record it in `committed` when their worker reports a
saved checkpoint. Where that is unknown for a failed group (no checkpoint ever reached the agent), the group's
progress is judged by the step the next group resumed from.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass, fields
from typing import Optional

from elastictrain.errors import AgentError
from elastictrain.rendezvous.client import EtcdClient

log = logging.getLogger(__name__)

DEFAULT_CRASH_LOOP_RESTARTS = 3
CRASH_LOOP_STEP_SLACK = 2
"""Restarts whose failure steps differ by at most this much count as failing at the same place."""


@dataclass(frozen=True)
class RestartPolicy:
    """The restart rules (validated as the `elastic` config section; defaults in docs/agent.md)."""

    max_restarts: int = 3
    crash_loop_restarts: int = DEFAULT_CRASH_LOOP_RESTARTS
    """0 turns crash-loop detection off."""
    max_no_progress_restarts: int = 5
    """0 turns no-progress detection off."""
    backoff_s: float = 1.0
    """Delay before the second restart of a streak without progress (doubling after); 0: no backoff."""
    backoff_max_s: float = 60.0
    backoff_jitter: float = 0.25
    """The delay varies by up to this fraction either way."""

    def backoff(self, streak: int, seed: str) -> float:
        """Seconds to wait before the restart that makes `streak` restarts in a row without progress."""
        if streak <= 1 or self.backoff_s == 0:
            return 0.0
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** (streak - 2))
        return delay * (1 + self.backoff_jitter * random.Random(seed).uniform(-1, 1))


@dataclass(frozen=True)
class RestartRecord:
    round: int
    node: str
    cause: str
    step: Optional[int]
    """The highest step any worker of the charging node reached before the failure (None: no step ran)."""
    time: float
    resumed_from: Optional[int] = None
    """The step the failed group started training at (None: it failed before its first step)."""
    committed: Optional[int] = None
    """The newest committed checkpoint step known when the restart was charged (None: unknown)."""

    @classmethod
    def from_json(cls, data: bytes) -> RestartRecord:
        raw = json.loads(data)
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


@dataclass(frozen=True)
class FatalRecord:
    """A worker error that a restart cannot fix: the job ended on its first occurrence."""

    node: str
    cause: str
    time: float


@dataclass(frozen=True)
class RestartState:
    """What `elastictrain status` shows of the policy."""

    used: int
    max_restarts: int
    no_progress: int
    """Restarts in a row, up to the newest, whose group made no progress."""
    max_no_progress_restarts: int
    backoff_s: float
    """The delay the newest restart waited."""
    fatal: Optional[FatalRecord]


class RestartBudgetExhausted(AgentError):
    pass


class CrashLoopError(AgentError):
    pass


class NoProgressError(AgentError):
    pass


class FatalWorkerError(AgentError):
    """A worker exited with an error that restarting cannot fix (EXIT_FATAL)."""


def made_progress(records: list[RestartRecord], i: int) -> bool:
    """Did the group that failed in `records[i]` commit a checkpoint newer than the one it resumed from?"""
    rec = records[i]
    if rec.resumed_from is None:
        return False  # it never trained a step
    if rec.committed is not None:
        return rec.committed > rec.resumed_from
    later = records[i + 1].resumed_from if i + 1 < len(records) else None
    return later is not None and later > rec.resumed_from


def no_progress_streak(records: list[RestartRecord]) -> int:
    """How many restarts in a row, up to the newest, made no progress."""
    n = 0
    for i in range(len(records) - 1, -1, -1):
        if made_progress(records, i):
            break
        n += 1
    return n


class RestartBudget:
    def __init__(self, client: EtcdClient, run_prefix: str, max_restarts: int = 3,
                 crash_loop_restarts: int = DEFAULT_CRASH_LOOP_RESTARTS, *, policy: Optional[RestartPolicy] = None):
        prefix = run_prefix.rstrip("/")
        self.client, self.prefix = client, prefix + "/restarts/"
        self._fatal_key, self._committed_key = prefix + "/fatal", prefix + "/committed"
        self.policy = policy or RestartPolicy(max_restarts=max_restarts, crash_loop_restarts=crash_loop_restarts)
        self._last_used = 0
        self._committed: Optional[int] = None

    @property
    def max_restarts(self) -> int:
        return self.policy.max_restarts

    def records(self) -> list[RestartRecord]:
        raw = self.client.get_prefix(self.prefix)
        return sorted((RestartRecord.from_json(v) for v in raw.values()), key=lambda r: r.round)

    def used(self, tolerant: bool = False) -> int:
        """Restarts charged so far; with `tolerant`, the last known count when etcd cannot be read."""
        try:
            self._last_used = self.client.count_prefix(self.prefix)
        except Exception:
            if not tolerant:
                raise
        return self._last_used

    def note_committed(self, step: int) -> None:
        """Record that a checkpoint of `step` was committed (from a worker's report); best effort."""
        if self._committed is not None and step <= self._committed:
            return
        self._committed = step
        try:
            current = self.committed()
            if current is None or step > current:
                self.client.put(self._committed_key, str(step).encode())
        except Exception as e:  # etcd down: progress is then judged by the next group's resume step
            log.debug("could not record committed step %d: %s", step, e)

    def committed(self) -> Optional[int]:
        got = self.client.get(self._committed_key)
        return int(got[0]) if got is not None else None

    def charge(self, round_: int, node: str, cause: str, step: Optional[int],
               resumed_from: Optional[int] = None) -> RestartRecord:
        """Charge the restart of `round_` (once per round, whoever comes first); raise when the job must end."""
        self._raise_if_fatal()
        rec = RestartRecord(round=round_, node=node, cause=cause, step=step, time=time.time(),
                            resumed_from=resumed_from, committed=self.committed())
        written, current, _ = self.client.cas(f"{self.prefix}{round_:08d}", json.dumps(asdict(rec)).encode(), None)
        if not written and current is not None:
            rec = RestartRecord.from_json(current)
        self._check(self.records(), rec.cause)
        return rec

    def backoff_s(self, records: Optional[list[RestartRecord]] = None) -> float:
        """How long to wait before the restart the newest record charged (same on every agent)."""
        records = self.records() if records is None else records
        if not records:
            return 0.0
        return self.policy.backoff(no_progress_streak(records), f"{self.prefix}{records[-1].round}")

    def record_fatal(self, node: str, cause: str) -> FatalRecord:
        """Record the error that ends the job (the first one recorded wins); returns the recorded one."""
        rec = FatalRecord(node=node, cause=cause, time=time.time())
        written, current, _ = self.client.cas(self._fatal_key, json.dumps(asdict(rec)).encode(), None)
        return rec if written or current is None else FatalRecord(**json.loads(current))

    def fatal(self) -> Optional[FatalRecord]:
        got = self.client.get(self._fatal_key)
        return None if got is None else FatalRecord(**json.loads(got[0]))

    def state(self) -> RestartState:
        records = self.records()
        return RestartState(used=len(records), max_restarts=self.policy.max_restarts,
                            no_progress=no_progress_streak(records),
                            max_no_progress_restarts=self.policy.max_no_progress_restarts,
                            backoff_s=round(self.backoff_s(records), 2), fatal=self.fatal())

    def final_error(self) -> Optional[AgentError]:
        """The error that ended the job, as the records show it, if any: for a node that finds the job ended."""
        try:
            self._raise_if_fatal()
            records = self.records()
            if records:
                self._check(records, records[-1].cause)
        except AgentError as e:
            return e
        except Exception:  # etcd unreachable: nothing to add
            log.debug("could not read the restart records", exc_info=True)
        return None

    def _raise_if_fatal(self) -> None:
        fatal = self.fatal()
        if fatal is not None:
            raise FatalWorkerError(fatal_message(fatal.node, fatal.cause))

    def _check(self, records: list[RestartRecord], cause: str) -> None:
        if len(records) > self.policy.max_restarts:
            raise RestartBudgetExhausted(
                f"restart budget spent: {len(records)} restarts > elastic.max_restarts={self.policy.max_restarts} "
                f"for the whole job; last cause: {cause}. Fix the cause, then raise --max-restarts or start a new "
                "run id")
        self._check_crash_loop(records)
        self._check_no_progress(records)

    def _check_crash_loop(self, records: list[RestartRecord]) -> None:
        """The last n restarts all died at the same step (or before any step): restarting cannot help."""
        n = self.policy.crash_loop_restarts
        if n <= 0 or len(records) < n:
            return
        recent = records[-n:]
        steps = [r.step for r in recent]
        # The step is the newest one the charging agent heard of: heartbeats are throttled (50 ms) and nodes see a
        # failure at slightly different moments, so the same crash reads as steps a little apart.
        same_place = all(s is None for s in steps) or (
            None not in steps and max(steps) - min(steps) <= CRASH_LOOP_STEP_SLACK)  # type: ignore[type-var]
        if same_place:
            where = "before the first step" if recent[0].step is None else f"at step {recent[0].step}"
            raise CrashLoopError(
                f"crash loop: the last {n} restarts all failed {where}; last cause: {recent[-1].cause}. "
                f"Fix the cause and run again: the job resumes from its newest valid checkpoint")

    def _check_no_progress(self, records: list[RestartRecord]) -> None:
        n = self.policy.max_no_progress_restarts
        if n <= 0 or no_progress_streak(records) < n:
            return
        recent = records[-n:]
        steps = sorted({r.step for r in recent if r.step is not None})
        where = f"at steps {', '.join(map(str, steps))}" if steps else "before any step"
        raise NoProgressError(
            f"no progress: the last {n} restarts (elastic.max_no_progress_restarts={n}) all failed {where} before "
            f"committing a checkpoint newer than the one they resumed from (step {recent[-1].resumed_from}); last "
            f"cause: {recent[-1].cause}. Fix the cause (or checkpoint more often: checkpoint.every_steps) and run "
            "again")


def fatal_message(node: str, cause: str) -> str:
    return (f"a worker on {node} failed with an error that restarting cannot fix, so the job ended without a "
            f"restart: {cause}")

