"""Restart budget, crash-loop detection and status/event records against a real etcd."""

import time

import pytest

from elastictrain.agent.budget import CrashLoopError, RestartBudget, RestartBudgetExhausted
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
    for r, step in enumerate([10, 30, 50, 70], start=1):
        budget.charge(r, "a", "flaky", step)


def test_status_and_events_are_published_and_readable(client):
    c, prefix = client
    pub = EtcdStatusPublisher(c, prefix, "node-a", max_restarts=3)
    pub.on_event("join", {"group_rank": 0, "world_size": 2})
    pub.on_event("failure", {"cause": "rank 1 exited with -9"})
    nodes = read_nodes(c, prefix)
    assert [n.node for n in nodes] == ["node-a"]
    assert nodes[0].state == "recovering" and nodes[0].world_size == 2 and nodes[0].max_restarts == 3
    assert time.time() - nodes[0].updated < 10
    events = read_events(c, prefix)
    assert [e.kind for e in events] == ["join", "failure"]
    assert events[1].fields["cause"] == "rank 1 exited with -9"
