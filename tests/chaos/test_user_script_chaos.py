"""Chaos on a user's script: examples/train_mlp.py (the public API, no recipe) under `elastictrain run`, 2 nodes on
localhost with a real etcd: the recipe's guarantees (tests/chaos/test_agent_chaos.py) hold for
any script written on `elastictrain.Worker`.

Each test asserts the job finishes (exit 0), the fault landed mid-run (a later launch re-ran steps of an earlier
one), every step of the committed history consumed exactly the samples of an uninterrupted run (exactly once), every
committed step ran at the world size the test expects (sample ledger; the checkpoints' manifests agree), and, where
the world size stayed 2, the final model and optimizer state are bitwise those of an uninterrupted 2-node run.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import pytest

from elastictrain.chaos.process_signals import drain_node
from elastictrain.runtime.audit import committed_timeline
from elastictrain.runtime.injected_faults import ENV_CHAOS
from tests.chaos.cluster import Node, ScriptJob, spans
from tests.integration.agent_etcd.job_records import restarts_and_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 32
"""Room for three faults 8 steps apart in one job (the recipe's chaos jobs run 24)."""
FAULT_STEP = 9  # checkpoints every 4 steps: the restarted group resumes from step 8
SECOND_FAULT_STEP = 17  # past the restarted group's first checkpoint (12) and the next (16)
THIRD_FAULT_STEP = 25  # past the checkpoints (20, 24) of the group re-formed after the hang
ON_TWO = {s: 2 for s in range(STEPS)}
STEP_FLOOR = {ENV_CHAOS: "slow@ms=100"}
"""Every step lasts at least 0.1 s, so a fault sent once step 9 is seen lands before the job ends, on a fast machine
as on a busy one (the steps of this MLP take a few ms)."""
WAIT_FOR_REJOIN = ("elastic.join_grace_s=60", "elastic.rejoin_wait_s=60")
"""The survivor waits for the node that left to come back, so every step runs on 2 ranks (see test_agent_chaos)."""


class BackgroundReference:
    """rank 0's summary of an uninterrupted run of the script on 2 ranks (plain torchrun), run in the background
    from `start()` (a test starts it where its job mostly waits) to `summary()`."""

    def __init__(self, job: ScriptJob) -> None:
        self.job = job
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.proc is None:
            self.proc = self.job.start_uninterrupted(2)

    def summary(self) -> dict:
        self.start()
        assert self.job.finish_uninterrupted(self.proc) == 0, self.job.uninterrupted_log()[-4000:]
        summary = self.job.summary()
        assert (summary["step"], summary["world_size"]) == (STEPS, 2), summary
        return summary

    def close(self) -> None:
        if self.proc is not None:
            self.job.stop_uninterrupted(self.proc)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Iterator[BackgroundReference]:
    ref = BackgroundReference(ScriptJob(tmp_path_factory.mktemp("reference"), endpoint="", run_id="reference",
                                        steps=STEPS))
    try:
        yield ref
    finally:
        ref.close()


@pytest.fixture
def job(tmp_path, etcd, run_id):
    j = ScriptJob(tmp_path, etcd.endpoint, run_id, steps=STEPS)
    yield j
    j.teardown()


def start_two(job: ScriptJob) -> tuple[Node, Node]:
    a = job.start_node("a", STEP_FLOOR)
    b = job.start_node("b", STEP_FLOOR)
    job.wait_for_step(FAULT_STEP, world_size=2)
    return a, b


def signal_worker(job: ScriptJob, node: Node, sig: signal.Signals) -> int:
    """Send `sig` to the node's (only) worker; returns its pid."""
    (pid,) = job.wait_workers(node).values()
    os.kill(pid, sig)
    return pid


def assert_exactly_once(job: ScriptJob, sizes: dict[int, int]) -> dict:
    """Finished at `STEPS`, every step's samples once, at the expected world sizes; returns rank 0's summary."""
    summary = job.summary()
    assert (summary["step"], summary["world_size"]) == (STEPS, sizes[STEPS - 1]), summary
    assert len({r["launch"] for r in job.records()}) > 1, "the fault landed after the job's only launch"
    assert committed_timeline(job.out / "samples") == {s: job.expected_samples(s) for s in range(STEPS)}, \
        "every step must consume exactly the samples of an uninterrupted run, once"
    job.assert_world_sizes(sizes)
    return summary


def assert_bitwise(summary: dict, reference: dict) -> None:
    for key in ("model", "optim"):
        assert reference[key] and summary[key] == reference[key], f"final {key} state differs from the reference's"


def test_worker_faults_then_a_node_sigkill_restart_the_script_and_it_ends_bitwise_identical(job, reference):
    """Three faults in one job (one 2-node run instead of two), each once the group before it is past its next
    checkpoints: a worker SIGKILL; a worker SIGSTOP that the agent must call hung (after its 3 s floor); node b
    SIGKILLed (agent and worker, no goodbye: its etcd lease expires) and started again by the same command, which the
    survivor waits for, so every step runs on 2 ranks."""
    job.overrides.extend(WAIT_FOR_REJOIN)  # the agents' settings, before any starts
    a, b = start_two(job)
    signal_worker(job, b, signal.SIGKILL)
    job.wait_for_step(SECOND_FAULT_STEP, world_size=2)
    stopped = signal_worker(job, b, signal.SIGSTOP)
    stopped_in = max(r["seq"] for r in job.records())
    job.wait_for_step(THIRD_FAULT_STEP, world_size=2, after_seq=stopped_in)
    b.kill()
    # The hang is behind us: the reference may load the CPU now (while a waits for b's lease to expire), not before,
    # where slower steps would lengthen the hang timeout (5 x p99 step time).
    reference.start()
    b2 = job.start_node("b-rejoined", STEP_FLOOR)
    assert job.wait([a, b2]) == [0, 0], job.logs()
    assert_bitwise(assert_exactly_once(job, ON_TWO), reference.summary())
    assert len({r["launch"] for r in job.records()}) >= 4, "the three faults landed mid-run (four launches)"
    used, events = restarts_and_events(job.endpoint, job.run_id)
    assert used >= 2 and any(e.kind == "failure" for e in events), [(e.kind, e.fields) for e in events]
    hangs = [e for e in events if e.kind == "hang"]
    assert any(str(stopped) in e.fields["cause"] and "stopped" in e.fields["cause"] for e in hangs), hangs


@pytest.mark.parametrize("in_place", [False, True], ids=["re-form", "in-place"])
def test_drained_node_leaves_and_the_other_finishes_alone_consuming_each_sample_once(tmp_path, etcd, run_id,
                                                                                    in_place):
    """A drain re-forms the other node's group alone; with elastic.in_place the other node's worker goes on in place
    instead, its model built again on the smaller world's mesh by the script's own `rebuild`."""
    job = ScriptJob(tmp_path, etcd.endpoint, run_id, steps=STEPS,
                    extra_overrides=("elastic.in_place=true",) if in_place else ())
    try:
        _drain_and_finish(job, in_place)
    finally:
        job.teardown()


def _drain_and_finish(job: ScriptJob, in_place: bool) -> None:
    a, b = start_two(job)
    kept = job.wait_workers(a)
    drain_node(b.pid)
    assert job.wait([b]) == [0], "a drained node exits 0\n" + job.logs()
    assert job.wait([a]) == [0], job.logs()
    ran = {s: c["world_size"] for s, c in job.committed().items()}
    alone = min((s for s, w in ran.items() if w == 1), default=STEPS)
    assert FAULT_STEP <= alone < STEPS, f"the drain must shrink the world mid-run: {spans(ran)}"
    assert_exactly_once(job, {s: 2 if s < alone else 1 for s in range(STEPS)})
    on_two = max(r["step"] for r in job.records() if r["world_size"] == 2)
    assert on_two == alone - 1, f"the drain saves the step it stopped at: step {on_two} ran on 2 ranks, then redone"
    used, events = restarts_and_events(job.endpoint, job.run_id)
    assert "drain" in [e.kind for e in events]
    assert used == 0, "a drain must not spend the restart budget"
    if in_place:
        assert [e.fields["reason"] for e in events if e.kind == "shrink" and e.fields.get("recorded_here")] == \
            ["node drained"], [(e.kind, e.fields) for e in events]
        assert not [e for e in events if e.kind in ("reform", "restart")], "the group re-formed instead"
        # An agent starts workers only at a join or a restart: a's one join started the process that finished.
        (joined,) = [e.fields["pids"] for e in events if e.kind == "join" and e.fields["agent_pid"] == a.pid]
        assert list(joined.values()) == list(kept.values()), (joined, kept)
