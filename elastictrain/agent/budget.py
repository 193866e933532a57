"""The job-wide restart budget and crash-loop detection, kept in etcd (not per agent: pytorch#108158).

One failure makes every agent of the group restart (its own worker died, or a collective on a dead peer
failed), so a restart is charged per *rendezvous round*: the first agent to record `restarts/<round>` charges
it, the others find it there. The budget is the number of such records. A crash loop is `crash_loop_restarts`
charged restarts in a row that all failed at the same step, give or take `CRASH_LOOP_STEP_SLACK` (or before
any step): then the job ends with a clear error instead of spending the rest of the budget.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Optional

from elastictrain.errors import AgentError
from elastictrain.rendezvous.client import EtcdClient

log = logging.getLogger(__name__)

DEFAULT_CRASH_LOOP_RESTARTS = 3
CRASH_LOOP_STEP_SLACK = 2
"""Restarts whose failure steps differ by at most this much count as failing at the same place."""


@dataclass(frozen=True)
class RestartRecord:
    round: int
    node: str
    cause: str
    step: Optional[int]
    """The highest step any worker of the charging node reached before the failure (None: no step ran)."""
    time: float


class RestartBudgetExhausted(AgentError):
    pass


class CrashLoopError(AgentError):
    pass


class RestartBudget:
    def __init__(self, client: EtcdClient, run_prefix: str, max_restarts: int,
                 crash_loop_restarts: int = DEFAULT_CRASH_LOOP_RESTARTS):
        self.client, self.prefix = client, run_prefix.rstrip("/") + "/restarts/"
        self.max_restarts, self.crash_loop_restarts = max_restarts, crash_loop_restarts
        self._last_used = 0

    def records(self) -> list[RestartRecord]:
        raw = self.client.get_prefix(self.prefix)
        return sorted((RestartRecord(**json.loads(v)) for v in raw.values()), key=lambda r: r.round)

    def used(self, tolerant: bool = False) -> int:
        """Restarts charged so far; with `tolerant`, the last known count when etcd cannot be read."""
        try:
            self._last_used = self.client.count_prefix(self.prefix)
        except Exception:
            if not tolerant:
                raise
        return self._last_used

    def charge(self, round_: int, node: str, cause: str, step: Optional[int]) -> RestartRecord:
        """Charge the restart of `round_` (once per round, whoever comes first); raise when none is left."""
        rec = RestartRecord(round=round_, node=node, cause=cause, step=step, time=time.time())
        written, current, _ = self.client.cas(f"{self.prefix}{round_:08d}", json.dumps(asdict(rec)).encode(), None)
        if not written and current is not None:
            rec = RestartRecord(**json.loads(current))
        self._check(self.records(), rec.cause)
        return rec

    def final_error(self) -> Optional[str]:
        """The budget or crash-loop error the records show, if any: for a node that finds the job ended."""
        try:
            records = self.records()
            if records:
                self._check(records, records[-1].cause)
        except AgentError as e:
            return str(e)
        except Exception:  # etcd unreachable: nothing to add
            log.debug("could not read the restart records", exc_info=True)
        return None

    def _check(self, records: list[RestartRecord], cause: str) -> None:
        if len(records) > self.max_restarts:
            raise RestartBudgetExhausted(
                f"restart budget spent: {len(records)} restarts > elastic.max_restarts={self.max_restarts} for the "
                f"whole job; last cause: {cause}. Fix the cause, then raise --max-restarts or start a new run id")
        self._check_crash_loop(records)

    def _check_crash_loop(self, records: list[RestartRecord]) -> None:
        """The last n restarts all died at the same step (or before any step): restarting cannot help."""
        n = self.crash_loop_restarts
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
