"""The time ledger's ETTR and the goodput benchmark's goodput, fed the same run (issue #18).

One simulated 2-node job gives both accountings their own input, as a real run does: the steps every rank
completed, timestamped (what `benchmarks/goodput.py` reads from the sample ledgers: `analyse`), and the events the
agents write to etcd for the same faults (what `elastictrain status` reads: `ledger.compute` / `ledger.window`).
The mapping the docs state (docs/benchmarks.md, goodput section; docs/cli.md, the ledger): over the same window,

    goodput = (training + checkpoint) / wall  x  fault-free step time / step time while training

so at the fault-free pace goodput = `productive` = ETTR + checkpoint / wall; a slower pace while training (one rank
alone, a cold replacement worker, a straggler) lowers goodput and leaves ETTR as it was. Steps the benchmark calls
thrown away are the steps the ledger calls recomputed.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest

from benchmarks.goodput import analyse
from benchmarks.recovery import Completed
from elastictrain.agent.ledger import compute, window

T = 0.1
"""Seconds per step at the fault-free pace."""
SAVE_EVERY, SAVE_BLOCK = 10, 0.05
NOTICE, RESTART, LOAD, SILENCE = 0.1, 2.0, 1.0, 5.0
"""A crash is noticed 0.1 s after it, a hang after 5 s of silence; re-forming takes 2 s, loading 1 s."""
T0 = 1_000.0
T_BASE, T_WINDOW, T_END = T0 + 5, T0 + 20, T0 + 80
"""The benchmark's phases: fault-free baseline from T_BASE, the fault window [T_WINDOW, T_END]."""


class Run:
    """A job's life as both records show it: completed steps (seq = the launch) and the agents' events."""

    def __init__(self) -> None:
        self.t = T0
        self.events: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []
        self.done: list[Completed] = []
        self.fired: list[dict[str, Any]] = []
        self.seq = self.count = self.saved = 0
        self.last_step_at = T0
        self.pace = T
        self.slow_first_run_s = 0.0
        """Seconds that steps run for the first time inside the window took beyond the fault-free pace."""
        self._reached = 0

    def ev(self, t: float, node: str, kind: str, **fields: Any) -> None:
        self.events.append({"time": t, "node": node, "kind": kind, "fields": fields})

    def group(self, at: float, loaded: Optional[int] = None) -> None:
        """A group formed at `at` (both nodes joined); `loaded`: the checkpoint step it loads."""
        self.ev(at, "a", "join", group_rank=0, world_size=2)
        self.ev(at, "b", "join", group_rank=1, world_size=2)
        self.t, self.seq = at, self.seq + 1
        if loaded is not None:
            self.t += LOAD
            self.ev(self.t, "a", "checkpoint_loaded", step=loaded, rank=0)
            self.count = loaded

    def train_until(self, t_stop: float) -> None:
        """Steps that complete by `t_stop`; every 10th saves (training blocked SAVE_BLOCK s)."""
        while self.t + self.pace <= t_stop:
            self.t += self.pace
            self.done.append(Completed(self.t, self.seq, self.count, 2))
            if self.count >= self._reached and T_WINDOW < self.t <= T_END:
                self.slow_first_run_s += self.pace - T
            self.count += 1
            self._reached = max(self._reached, self.count)
            self.last_step_at = self.t
            if self.count % SAVE_EVERY == 0:
                self.t += SAVE_BLOCK
                self.ev(self.t, "a", "checkpoint_saved", step=self.count, blocking_s=SAVE_BLOCK, rank=0,
                        url=f"file:///ckpt/step-{self.count}")
                self.saved = self.count

    def worker_kill(self, at: float) -> None:
        """SIGKILL of node b's worker at `at`: the step in flight is lost, the job resumes from the last save."""
        self.train_until(at)
        self.fired.append({"kind": "worker", "node": "b", "time": at, "scheduled_s": round(at - T_WINDOW, 2)})
        noticed = at + NOTICE
        age = round(noticed - self.last_step_at, 3)
        self.ev(noticed, "b", "failure", cause="rank 1: Signal 9 (SIGKILL)", step_reached=self.count,
                failures=[{"global_rank": 1, "last_beat_age_s": age}])
        self.ev(noticed + 0.01, "b", "restart", reason="failure", step_reached=self.count)
        self.ev(noticed + 0.3, "a", "restart", reason="membership change", step_reached=self.count)
        self.restarts.append({"time": noticed, "step": self.count})
        self.group(noticed + RESTART, loaded=self.saved)

    def hang(self, at: float) -> None:
        """Node a's worker goes silent at `at`; its agent notices after SILENCE s and restarts the group."""
        self.train_until(at)
        self.fired.append({"kind": "worker", "node": "a", "time": at, "scheduled_s": round(at - T_WINDOW, 2)})
        noticed = at + SILENCE
        self.ev(noticed, "a", "hang", cause="rank 0 silent",
                workers=[{"step": self.count, "silent_s": round(noticed - self.last_step_at, 3)}])
        self.ev(noticed + 0.01, "a", "restart", reason="failure", step_reached=self.count)
        self.ev(noticed + 0.3, "b", "restart", reason="membership change", step_reached=self.count)
        self.restarts.append({"time": noticed, "step": self.count})
        self.group(noticed + RESTART, loaded=self.saved)

    def step_at(self, t: float) -> int:
        """The step count the job had reached at `t` (its nodes' reported step)."""
        return max((c.step + 1 for c in self.done if c.time <= t and c.seq == max(
            d.seq for d in self.done if d.time <= t)), default=0)


def simulate(slow_between: Optional[tuple[float, float]] = None, slow_pace: float = T) -> Run:
    """Start (3 s to form), fault-free until the window, then a worker kill, a hang and a worker kill.
    `slow_between`: steps starting in that span run at `slow_pace` (the job on one rank, a straggler)."""
    r = Run()
    r.group(T0 + 3.0)
    marks = [(T0 + 31.03, r.worker_kill), (T0 + 47.52, r.hang), (T0 + 66.21, r.worker_kill)]
    for at, fault in marks:
        if slow_between is not None and r.t < slow_between[0] < at:
            r.train_until(slow_between[0])
            r.pace = slow_pace
            r.train_until(min(at, slow_between[1]))
            r.pace = T
        fault(at)
    r.train_until(T_END + 5)
    return r


def both(r: Run) -> tuple[dict, dict]:
    """The benchmark's figures (`analyse`) and the ledger's over the same window."""
    bench = analyse(r.done, r.fired, T_BASE, T_WINDOW, T_END)
    led = window(r.events, restarts=r.restarts, started=T0, since=T_WINDOW, until=T_END,
                 since_step=r.step_at(T_WINDOW), until_step=r.step_at(T_END))
    return bench, led


def test_at_the_fault_free_pace_goodput_is_training_plus_checkpoint_over_wall_and_ettr_is_that_less_saves():
    r = simulate()
    bench, led = both(r)
    assert bench["faults_fired"] == bench["recoveries"] == led["faults"] == 3
    assert sum(led["buckets"].values()) == pytest.approx(led["wall_s"], rel=0.01)
    # the same work counted twice: once as steps at the fault-free pace, once as seconds
    assert led["productive"] == pytest.approx(bench["goodput"], abs=0.01)
    assert led["ettr"] == pytest.approx(bench["goodput"] - led["buckets"]["checkpoint"] / led["wall_s"], abs=0.01)
    assert led["ettr"] < bench["goodput"]
    # what goodput lost is what the ledger's lost buckets hold (detect + restart + load + recompute)
    assert led["lost_s"] / led["wall_s"] == pytest.approx(1 - bench["goodput"], abs=0.01)
    assert led["recomputed_steps"] == bench["steps_thrown_away"] == bench["steps_lost_total"] > 0
    # the whole job's ETTR (what `status` shows) also counts the start and the fault-free baseline
    job = compute(r.events, restarts=r.restarts, started=T0, now=T_END, current_step=r.step_at(T_END))
    assert job.ettr > led["ettr"] and job.buckets["starting"] == pytest.approx(3.0)


def test_a_slower_pace_while_training_lowers_goodput_and_not_ettr():
    """Between the hang's recovery and the last kill the job steps at 1.5x the fault-free step time (as on one rank
    or beside a worker importing torch): ETTR counts those seconds as training, goodput counts the steps."""
    fast_bench, fast = both(simulate())
    r = simulate(slow_between=(T0 + 56.0, T0 + 66.21), slow_pace=1.5 * T)
    bench, led = both(r)
    assert r.slow_first_run_s > 1.0
    assert led["productive"] == pytest.approx(fast["productive"], abs=0.01)
    assert bench["goodput"] < fast_bench["goodput"] - 0.02
    # the gap is the seconds first-run steps took beyond the fault-free pace, over the window
    assert led["productive"] - bench["goodput"] == pytest.approx(r.slow_first_run_s / led["wall_s"], abs=0.01)
