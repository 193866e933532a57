"""Pause in place (`elastic.in_place`) under a real 2-node `elastictrain run`: a SIGKILLed worker is replaced alone;
the other node's worker keeps its process and state, waits at the step boundary, rebuilds the process group with the
replacement and continues from the newest in-memory snapshot; the job ends bitwise-equal to an uninterrupted run."""

from __future__ import annotations

import signal

import pytest

from elastictrain.chaos.process_signals import signal_worker
from tests.chaos.cluster import Job
from tests.chaos.test_agent_chaos import ON_TWO, WAIT_FOR_REJOIN, assert_recovered, events, start_two
from tests.chaos.test_snapshot_chaos import SNAPSHOTS
from tests.integration.recipe_runs import assert_same_train_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

IN_PLACE = (*SNAPSHOTS, "elastic.in_place=true", *WAIT_FOR_REJOIN)


@pytest.fixture
def in_place_job(tmp_path, etcd, run_id):
    j = Job(tmp_path, etcd.endpoint, run_id, extra_overrides=IN_PLACE)
    yield j
    j.teardown()


def test_a_killed_then_a_stopped_worker_are_replaced_alone_then_a_lost_node_falls_back_to_a_restart(in_place_job,
                                                                                                   reference):
    """A worker SIGKILL, then a worker SIGSTOP (a hang: its agent kills and replaces it; the other node's agent sees
    its own worker silent but waiting, and gives the peer's agent time): each time the survivor keeps its process,
    only the victim is replaced, at most one step is redone. Then a node SIGKILL (agent and worker: no agent is left
    to replace its rank) and the same command again: the survivor sees the node's lease expire while paused, gives up
    the in-place path, and the agents restart every worker and re-form with the re-joined node. The job ends
    bitwise-equal to an uninterrupted run, every sample consumed exactly once."""
    job = in_place_job
    a, b = start_two(job)
    survivor = job.wait_workers(a)
    saved = job.valid_checkpoints()
    reached = []
    for fault in (signal.SIGKILL, signal.SIGSTOP):
        victim = job.wait_workers(b)
        reached.append(job.max_step())
        signal_worker(b.pid, fault)
        job.wait_for_step(reached[-1] + 3, world_size=2)
        assert job.wait_workers(a) == survivor, f"{fault.name}: the survivor was restarted instead of pausing in place"
        assert job.wait_workers(b) != victim, f"{fault.name}: the victim was not replaced"
    evs = events(job)
    replaced = [e for e in evs if e.kind == "restart" and e.fields.get("in_place")]
    assert [e.fields["replaced_ranks"] for e in replaced] == [[1], [1]], [(e.kind, e.fields) for e in evs]
    resumed = [e for e in evs if e.kind == "in_place_resumed"]
    assert len(resumed) == 2, [(e.kind, e.fields) for e in evs]
    # The snapshot of the step before each fault (or the fault's own) is where both continue: at most one step redone.
    for e, r in zip(resumed, reached):
        assert e.fields["step"] >= r - 1, (e.fields, r)
    assert sum(1 for e in evs if e.kind == "join") == 2, "the agents re-formed the group instead of pausing in place"
    assert [e for e in evs if e.kind == "hang"], "the stopped worker was not caught as hung"

    b.kill()
    b = job.start_node("b")
    assert job.wait([a, b]) == [0, 0], job.logs()
    summary = assert_recovered(job, saved, ON_TWO)
    assert_same_train_state(summary, reference.summary)
    evs = events(job)
    assert [e for e in evs if e.kind == "restart" and not e.fields.get("in_place")], \
        "the node loss did not fall back to a restart of every worker"
    assert len([e for e in evs if e.kind == "restart" and e.fields.get("in_place")]) == 2, \
        "a lost node's rank was 'replaced in place' with no agent to start it"
