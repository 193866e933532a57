"""Restart budget, crash-loop detection and status/event records against a real etcd."""

import time

import pytest

from elastictrain.agent.budget import (
    CrashLoopError,
    FatalWorkerError,
    NoProgressError,
    RestartBudget,
    RestartBudgetExhausted,
    RestartPolicy,
)
from elastictrain.agent.status import EtcdStatusPublisher, read_events, read_nodes
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.settings import EtcdSettings


@pytest.fixture
def client(etcd, run_id):
    settings = EtcdSettings.from_conf(etcd.endpoint, run_id, {})
    c = EtcdClient(settings)
    c.connect()
    yield c, settings.run_prefix
    c.delete_prefix(settings.run_prefix)
    c.close()


def test_restart_is_charged_once_per_round_whoever_reports_it(client):
    c, prefix = client
    budget = RestartBudget(c, prefix, max_restarts=3, crash_loop_restarts=0)
    budget.charge(1, "node-a", "rank 1 exited with -9", step=5)
    again = budget.charge(1, "node-b", "collective failed", step=5)
    assert again.node == "node-a"      # the first report of the round wins
    assert budget.used() == 1


def test_budget_is_job_wide_and_exhaustion_is_a_clear_error(client):
    c, prefix = client
    a = RestartBudget(c, prefix, max_restarts=2, crash_loop_restarts=0)
    b = RestartBudget(c, prefix, max_restarts=2, crash_loop_restarts=0)  # another agent, same job
    a.charge(1, "a", "x", 3)
    b.charge(2, "b", "y", 9)
    with pytest.raises(RestartBudgetExhausted, match="max_restarts=2"):
        a.charge(3, "a", "oom", 14)


def test_crash_loop_ends_the_job_when_restarts_make_no_progress(client):
    c, prefix = client
    budget = RestartBudget(c, prefix, max_restarts=100, crash_loop_restarts=3)
    budget.charge(1, "a", "boom", 10)
    budget.charge(2, "a", "boom", 57)
    budget.charge(3, "a", "boom", 57)
    with pytest.raises(CrashLoopError, match="at step 5[67]"):
        budget.charge(4, "a", "boom", 56)


def test_restarts_that_make_progress_are_not_a_crash_loop(client):
    c, prefix = client
    budget = RestartBudget(c, prefix, max_restarts=100, crash_loop_restarts=3)
    for r, step in enumerate([10, 30, 50, 70, 90, 110], start=1):
        budget.charge(r, "a", "flaky", step, resumed_from=step - 10)  # each group committed one checkpoint


def test_status_and_events_are_published_and_readable(client):
    c, prefix = client
    pub = EtcdStatusPublisher(c, prefix, "node-a", max_restarts=3)
    pub.on_event("join", {"group_rank": 0, "world_size": 2})
    pub.on_event("failure", {"cause": "rank 1 exited with -9"})
    assert read_events(c, prefix) == [], "on_event only queues: the agent's monitor thread never waits for etcd"
    pub.flush()
    nodes = read_nodes(c, prefix)
    assert [n.node for n in nodes] == ["node-a"]
    assert nodes[0].state == "recovering" and nodes[0].world_size == 2 and nodes[0].max_restarts == 3
    assert time.time() - nodes[0].updated < 10
    events = read_events(c, prefix)
    assert [e.kind for e in events] == ["join", "failure"]
    assert events[1].fields["cause"] == "rank 1 exited with -9"


def test_failures_at_scattered_steps_without_a_new_checkpoint_end_the_job(client):
    """Each restart resumes from step 40 and fails before the next checkpoint, at a different step each time:
    not a crash loop, yet restarting cannot get past step 40."""
    c, prefix = client
    policy = RestartPolicy(max_restarts=100, max_no_progress_restarts=3)
    budget = RestartBudget(c, prefix, policy=policy)
    budget.note_committed(40)
    budget.charge(1, "a", "oom", 43, resumed_from=40)
    budget.charge(2, "a", "nccl timeout", 47, resumed_from=40)
    with pytest.raises(NoProgressError, match=r"last 3 restarts .*steps 43, 45, 47.*resumed from \(step 40\)"):
        budget.charge(3, "a", "ecc error", 45, resumed_from=40)
    # what another agent of the job says when it finds the rendezvous closed
    assert isinstance(RestartBudget(c, prefix, policy=policy).final_error(), NoProgressError)


def test_a_committed_checkpoint_resets_the_no_progress_streak_and_the_backoff(client):
    c, prefix = client
    policy = RestartPolicy(max_restarts=100, crash_loop_restarts=0, max_no_progress_restarts=3, backoff_s=1.0,
                           backoff_jitter=0.0)
    budget = RestartBudget(c, prefix, policy=policy)
    budget.note_committed(40)
    budget.charge(1, "a", "x", 43, resumed_from=40)
    assert budget.backoff_s() == 0.0, "the first restart of a streak is immediate"
    budget.charge(2, "a", "x", 44, resumed_from=40)
    assert budget.backoff_s() == 1.0
    budget.note_committed(50)  # this group got past a checkpoint before it failed
    budget.charge(3, "a", "x", 52, resumed_from=40)
    assert budget.state().no_progress == 0 and budget.backoff_s() == 0.0
    budget.charge(4, "a", "x", 53, resumed_from=50)
    budget.charge(5, "a", "x", 51, resumed_from=50)
    assert budget.state().no_progress == 2


def test_without_committed_reports_progress_is_judged_by_where_the_next_group_resumed(client):
    c, prefix = client
    budget = RestartBudget(c, prefix, policy=RestartPolicy(max_restarts=100, max_no_progress_restarts=3))
    budget.charge(1, "a", "x", 13, resumed_from=0)
    budget.charge(2, "a", "x", 27, resumed_from=10)  # the first group committed step 10 before it failed
    budget.charge(3, "a", "x", 21, resumed_from=20)
    assert budget.state().no_progress == 1  # only the newest group is not known to have made progress


def test_backoff_doubles_up_to_its_cap_and_every_agent_of_a_job_waits_alike(client):
    c, prefix = client
    policy = RestartPolicy(max_restarts=100, crash_loop_restarts=0, max_no_progress_restarts=0, backoff_s=2.0,
                           backoff_max_s=10.0, backoff_jitter=0.25)
    a, b = RestartBudget(c, prefix, policy=policy), RestartBudget(c, prefix, policy=policy)
    waits = []
    for r in range(1, 7):
        a.charge(r, "a", "x", 5, resumed_from=0)
        waits.append(a.backoff_s())
        assert b.backoff_s() == waits[-1], "the other agent of the job computes the same wait"
    assert waits[0] == 0.0
    for wait, nominal in zip(waits[1:], [2, 4, 8, 10, 10]):
        assert 0.75 * nominal <= wait <= 1.25 * nominal, waits
    assert len(set(waits[-2:])) == 2, "jitter differs from one round to the next"


def test_a_fatal_worker_error_ends_the_job_on_every_agent_with_its_cause(client):
    c, prefix = client
    a, b = RestartBudget(c, prefix, max_restarts=10), RestartBudget(c, prefix, max_restarts=10)
    first = a.record_fatal("node-a", "rank 0: checkpoint step 8 does not fit the model")
    assert b.record_fatal("node-b", "rank 1: peer closed").cause == first.cause, "the first cause recorded wins"
    with pytest.raises(FatalWorkerError, match="restarting cannot fix.*checkpoint step 8 does not fit"):
        b.charge(1, "node-b", "rank 1: connection closed by peer", 3, resumed_from=0)
    assert b.used() == 0, "no restart is charged once the job has ended"
    err = RestartBudget(c, prefix).final_error()
    assert isinstance(err, FatalWorkerError) and "does not fit the model" in str(err)
