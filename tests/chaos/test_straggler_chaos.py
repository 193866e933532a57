"""`elastic.replace_stragglers` on a real 2-node job (etcd, 2 `elastictrain run` agents): node b's worker is slow
before every step (the chaos `slow@` fault, set on node b only, so it follows the node whatever its rank).

Its rank is named a straggler, confirmed still slow 5 steps later, and replaced: first by a restart of the group's
workers at a step boundary (a fresh process may cure it), then, the same host straggling again, by draining node b.
Nothing is lost: every re-formed group resumes at the very step the previous one stopped at (no step runs twice),
every step consumes exactly the samples of an uninterrupted run, and the restart budget is not charged. With the
setting off (the default) a straggler is only reported: tests/integration/cli/test_status_live.py.

Where a drained node goes, a node waiting beyond max_nodes comes in: torch's rendezvous keeps it in its redundancy
list (our etcd rendezvous too) and lets it join the re-formed group.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from elastictrain.agent.status import NodeStatus, read_nodes
from elastictrain.chaos.process_signals import drain_node
from elastictrain.cli.main import main as cli
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.settings import EtcdSettings
from elastictrain.runtime.audit import committed_timeline
from elastictrain.runtime.injected_faults import ENV_CHAOS
from tests.chaos.cluster import Job, expected_samples
from tests.chaos.test_agent_chaos import events, restarts_charged

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 90
"""Naming takes 20 slow steps and confirming 5 more, twice (restart, then drain): the rest run on node a alone."""


@pytest.fixture
def job(tmp_path, etcd, run_id):
    j = Job(tmp_path, etcd.endpoint, run_id, steps=STEPS, extra_overrides=(
        "elastic.replace_stragglers=true", "elastic.straggler_replace_after_steps=5",
        "checkpoint.every_steps=1000"))  # no periodic saves: only the stop at the boundary can keep the progress
    yield j
    j.teardown()


def test_a_confirmed_straggler_is_restarted_then_its_node_drained_and_nothing_is_lost(job):
    a = job.start_node("a")
    b = job.start_node("b", env={ENV_CHAOS: "slow@ms=150"})
    assert job.wait([b], timeout=240) == [0], "the drained node exits 0\n" + job.logs()
    assert job.wait([a], timeout=120) == [0], job.logs()

    replaced = [e for e in events(job) if e.kind == "straggler_replaced"]
    assert [e.fields["action"] for e in replaced] == ["restart", "drain"], job.logs()
    assert all(e.fields["agent_pid"] == b.pid for e in replaced), "node b's agent replaced its own rank"
    assert all(e.fields["lateness_s"] > 0.1 for e in replaced), replaced

    # Three launches, each resuming at the step the previous one stopped at: no step lost, none run twice.
    launches, sizes = history(job)
    assert len(launches) == 3, [(s[0], s[-1]) for s in launches]
    assert committed_timeline(job.out / "samples") == {s: expected_samples(s) for s in range(STEPS)}, \
        "every step must consume exactly the samples of an uninterrupted run, once"
    drained_at = launches[2][0]
    assert sizes == {s: 2 if s < drained_at else 1 for s in range(STEPS)}, "2 ranks until the drain, then node a"
    assert job.summary()["final_step"] == STEPS
    assert restarts_charged(job) == 0, "replacing a straggler must not spend the restart budget"
    node_b = node_status(job, b.pid)
    assert node_b.stragglers_replaced == {"restart": 1, "drain": 1} and node_b.state == "left", node_b
    assert node_b.last_replacement["action"] == "drain" and node_b.last_replacement["slow_rank"] == 1


def test_a_node_waiting_beyond_max_nodes_takes_the_place_of_a_drained_one(tmp_path, etcd, run_id):
    """The drain a straggler's replacement ends with, seen from a standby node: c waits (no workers) while a and b
    train, and joins the group that re-forms when b drains; every step runs on 2 ranks, exactly once."""
    job = Job(tmp_path, etcd.endpoint, run_id, steps=40, extra_overrides=("checkpoint.every_steps=1000",))
    try:
        a, b = job.start_node("a"), job.start_node("b")
        job.wait_for_step(3, world_size=2)
        operator(job, "pause")  # holds the job at a step boundary until c is waiting, whatever the machine's speed
        c = job.start_node("c")
        deadline = time.monotonic() + 180
        while "joining the rendezvous" not in c.log():
            assert c.alive() and time.monotonic() < deadline, job.logs()
            time.sleep(0.2)
        time.sleep(3)
        assert not c.workers(), "a node beyond max_nodes waits without workers"
        drain_node(b.pid)
        assert job.wait([b], timeout=120) == [0], job.logs()
        operator(job, "resume")
        assert job.wait([a, c], timeout=180) == [0, 0], job.logs()
    finally:
        job.teardown()
    launches, sizes = history(job)
    assert len(launches) == 2, [(s[0], s[-1]) for s in launches]
    assert sizes == {s: 2 for s in range(40)}, "b's place was taken at once: every step on 2 ranks"
    assert committed_timeline(job.out / "samples") == {s: expected_samples(s) for s in range(40)}
    assert "rendezvous complete" in c.log() and job.summary()["world_size"] == 2


def operator(job: Job, command: str) -> None:
    assert cli([command, "--yes", "--endpoint", job.endpoint, "--run-id", job.run_id]) == 0


def history(job: Job) -> tuple[list[list[int]], dict[int, int]]:
    """The steps of each launch, oldest first, each resuming at the step the one before stopped at (no step lost or
    run twice); and the world size each step ran at."""
    ran: dict[int, set[int]] = defaultdict(set)
    sizes = {}
    for r in job.records():
        ran[r["seq"]].add(r["step"])
        sizes[r["step"]] = r["world_size"]
    launches = [sorted(ran[seq]) for seq in sorted(ran)]
    for before, after in zip(launches, launches[1:]):
        assert after[0] == before[-1] + 1, f"launch resumed at {after[0]}, the one before stopped after {before[-1]}"
    return launches, sizes


def node_status(job: Job, agent_pid: int) -> NodeStatus:
    """The status record of the node whose agent had `agent_pid` (kept in etcd after it left)."""
    settings = EtcdSettings.from_conf(job.endpoint, job.run_id, {})
    client = EtcdClient(settings)
    client.connect()
    try:
        [found] = [n for n in read_nodes(client, settings.run_prefix) if n.agent_pid == agent_pid]
        return found
    finally:
        client.close()
