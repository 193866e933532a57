"""Run a fault schedule against a job: fire each fault when its step or time comes, heal it after its duration.

The runner knows nothing about processes or networks: a :class:`ChaosTarget` injects faults into one kind of
job (:class:`elastictrain.chaos.local.LocalTarget`: a live job on this machine; the network-namespace target:
simulated hosts). Faults fire one after another in schedule order; an unnamed node is chosen with
``random.Random(schedule.seed)`` among the target's live nodes (sorted), so the same seed and the same job give the
same choices. Every heal is waited for before :meth:`ChaosRunner.run` returns, including when the job finishes
early, the caller stops the run, or the timeout passes (then pending heals run at once).

Each fault yields one record (also appended as a JSON line to the event log)::

    {"fault": "kill-node:node1@step=8/3s", "kind": "kill-node", "node": "node1", "detail": "SIGKILL agent ...",
     "fired_at_s": 12.3, "fired_step": 8, "healed_at_s": 15.3, "skipped": null}

``skipped`` holds the reason a fault did not fire (the target cannot inject it, the job finished first, no live
node); ``heal_detail`` is added when the heal said what it did (e.g. the re-launched agent's pid), ``heal_error``
when undoing the fault failed.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from elastictrain.chaos.schedule import NODE_KINDS, Schedule, ScheduledFault
from elastictrain.errors import ElastictrainError

log = logging.getLogger(__name__)


class UnsupportedFault(ElastictrainError):
    """A target cannot inject this kind of fault (the message says what it would need)."""


@dataclass
class Injected:
    """A fault that was injected: where it hit, what was done, and how to undo it."""

    fault: ScheduledFault
    node: Optional[str]
    detail: str
    heal: Optional[Callable[[], Optional[str]]]
    """Undoes the fault; may return a line saying what it did (recorded as ``heal_detail``)."""


class ChaosTarget(Protocol):
    """A job faults can be injected into."""

    def nodes(self) -> list[str]:
        """Names of the nodes faults may target now (live ones)."""
        ...

    def step(self) -> Optional[int]:
        """Newest step the job completed, None if not known yet."""
        ...

    def finished(self) -> bool:
        """Whether the job ended (the runner stops firing)."""
        ...

    def inject(self, fault: ScheduledFault, node: Optional[str], rng: random.Random) -> Injected:
        """Inject `fault` into `node` (None for faults that hit no node); raise UnsupportedFault to skip it."""
        ...


EventCallback = Callable[[str, dict[str, Any]], None]


@dataclass
class _Pending:
    """A fired fault waiting for its heal."""

    due: float
    record: dict[str, Any]
    heal: Callable[[], Optional[str]]


@dataclass
class _Run:
    """The state of one ChaosRunner.run(): its start, how it may end, and the faults waiting for their heal."""

    t0: float
    stop: threading.Event
    timeout: Optional[float]
    pending: list[_Pending] = field(default_factory=list)
    last_fire: Optional[float] = None


class ChaosRunner:
    """Fire a schedule's faults into a target in order, heal each after its duration, log one record per fault."""

    def __init__(self, schedule: Schedule, target: ChaosTarget, *, event_log: Optional[str] = None,
                 min_gap_s: float = 0.0, clock: Callable[[], float] = time.monotonic, poll_s: float = 0.2,
                 sleep: Optional[Callable[[float], None]] = None, on_event: Optional[EventCallback] = None):
        """`min_gap_s`: least seconds between two fires; `sleep`: waits between polls (default: the stop event);
        `on_event(what, record)`: called with what in {"fired", "healed", "skipped"} (the CLI prints these)."""
        self.schedule = schedule
        self.target = target
        self.event_log = event_log
        self.min_gap_s = min_gap_s
        self.clock = clock
        self.poll_s = poll_s
        self._sleep = sleep
        self.on_event = on_event
        self.rng = random.Random(schedule.seed)

    def run(self, stop: Optional[threading.Event] = None, timeout: Optional[float] = None) -> list[dict]:
        """Run the whole schedule; returns one record per fault, in schedule order (see the module docstring)."""
        run = _Run(t0=self.clock(), stop=stop or threading.Event(), timeout=timeout)
        records: list[dict[str, Any]] = []
        try:
            for fault in self.schedule.faults:
                record = self._record(fault)
                records.append(record)
                reason = self._wait_until_due(run, fault)
                node: Optional[str] = None
                if reason is None and fault.kind in NODE_KINDS:
                    node, reason = self._choose_node(run, fault)
                if reason is not None:
                    self._skip(record, reason)
                    continue
                run.last_fire = self._now(run)
                self._fire(run, fault, node, record)
            while run.pending:  # every heal before returning (at once when the run is over)
                self._heal_due(run)
                if run.pending:
                    self._wait(run)
        finally:
            # Whatever went wrong above, leave no fault in place.
            self._heal_due(run, force=True)
        return records

    def _now(self, run: _Run) -> float:
        return self.clock() - run.t0

    def _over(self, run: _Run) -> Optional[str]:
        """Why the run must stop firing, or None."""
        if run.stop.is_set():
            return "the chaos run was stopped"
        if run.timeout is not None and self._now(run) >= run.timeout:
            return f"the chaos run timed out after {run.timeout:g}s"
        if self.target.finished():
            return "the job finished first"
        return None

    def _record(self, fault: ScheduledFault) -> dict[str, Any]:
        return {"fault": fault.describe(), "kind": fault.kind, "node": None, "detail": "", "fired_at_s": None,
                "fired_step": None, "healed_at_s": None, "skipped": None}

    def _wait(self, run: _Run) -> None:
        if self._sleep is not None:
            self._sleep(self.poll_s)
        else:
            run.stop.wait(self.poll_s)

    def _wait_until_due(self, run: _Run, fault: ScheduledFault) -> Optional[str]:
        """Wait until `fault` may fire (healing what comes due meanwhile); returns why it never will, or None."""
        while True:
            self._heal_due(run)
            reason = self._over(run)
            if reason is not None:
                return reason
            t = self._now(run)
            gap_ok = run.last_fire is None or t - run.last_fire >= self.min_gap_s
            if gap_ok and self._condition(fault, t):
                return None
            self._wait(run)

    def _condition(self, fault: ScheduledFault, t: float) -> bool:
        if fault.at_time is not None:
            return t >= fault.at_time
        if fault.at_step is not None:
            step = self.target.step()
            return step is not None and step >= fault.at_step
        return True

    def _choose_node(self, run: _Run, fault: ScheduledFault) -> tuple[Optional[str], Optional[str]]:
        """The node a node fault hits: its named target, else a seeded choice among live nodes (waits for one)."""
        if fault.target is not None:
            return fault.target, None
        while True:
            live = sorted(self.target.nodes())
            if live:
                return self.rng.choice(live), None
            # Every node may be down for a moment (a killed node re-launching); wait rather than skip.
            self._heal_due(run)
            reason = self._over(run)
            if reason is not None:
                return None, f"no live node to hit ({reason})"
            self._wait(run)

    def _fire(self, run: _Run, fault: ScheduledFault, node: Optional[str], record: dict[str, Any]) -> None:
        record["fired_step"] = self.target.step()
        try:
            injected = self.target.inject(fault, node, self.rng)
        except UnsupportedFault as e:
            self._skip(record, f"unsupported: {e}")
            return
        except Exception as e:  # a fault that fails to inject must not stop the rest of the schedule
            log.exception("chaos: injecting %s failed", fault.describe())
            self._skip(record, f"injection failed: {type(e).__name__}: {e}")
            return
        record.update(node=injected.node, detail=injected.detail, fired_at_s=round(self._now(run), 3))
        log.info("chaos: fired %s on %s at %.1fs (step %s): %s", fault.describe(), injected.node or "-",
                 record["fired_at_s"], record["fired_step"], injected.detail)
        self._emit("fired", record)
        if injected.heal is None:
            self._finish(record)
            return
        run.pending.append(_Pending(due=self._now(run) + (fault.heal_after or 0.0), record=record,
                                    heal=injected.heal))

    def _heal_due(self, run: _Run, force: bool = False) -> None:
        """Heal the pending faults that are due; all of them when forced or when the run is over."""
        if not run.pending:
            return
        force = force or self._over(run) is not None
        for p in [p for p in run.pending if force or self._now(run) >= p.due]:
            run.pending.remove(p)
            self._heal(run, p)

    def _heal(self, run: _Run, p: _Pending) -> None:
        try:
            said = p.heal()
            if said:
                p.record["heal_detail"] = said
        except Exception as e:  # keep healing the others; the record says what could not be undone
            log.exception("chaos: healing %s failed", p.record["fault"])
            p.record["heal_error"] = f"{type(e).__name__}: {e}"
        p.record["healed_at_s"] = round(self._now(run), 3)
        said = p.record.get("heal_detail") or ""
        if "heal_error" in p.record:
            said = f"heal failed: {p.record['heal_error']}"
        log.info("chaos: healed %s on %s at %.1fs%s", p.record["fault"], p.record["node"] or "-",
                 p.record["healed_at_s"], f": {said}" if said else "")
        self._emit("healed", p.record)
        self._finish(p.record)

    def _skip(self, record: dict[str, Any], reason: str) -> None:
        record["skipped"] = reason
        log.info("chaos: skipped %s: %s", record["fault"], reason)
        self._emit("skipped", record)
        self._finish(record)

    def _emit(self, what: str, record: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(what, dict(record))

    def _finish(self, record: dict[str, Any]) -> None:
        """The record is final: append it to the event log."""
        if self.event_log is None:
            return
        with open(self.event_log, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
