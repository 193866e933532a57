"""Peer replicas of the in-memory snapshots under a real 2-node `elastictrain run`: node b SIGKILLed (agent and
workers; its snapshot folder, i.e. its RAM, gone with it) and started again with the same command resumes from b's
snapshots as replicated on node a, recomputing at most one completed step, and ends bitwise-equal to an
uninterrupted run; the replicas travel over mutual TLS (elastic.replica_tls), or plain HTTP without openssl.

Without replicas the same fault resumes from the last durable checkpoint (every 4 steps here;
tests/chaos/test_agent_chaos.py::test_a_node_sigkilled_then_one_drained_each_rejoin_by_the_same_command).

Two neighbours of the replica ring lost at once (a node and the peer that holds its replica, of 3) leave a rank with
no copy anywhere: the job says so (`checkpoint_snapshot_skipped`: that rank holds none) and resumes from the durable
tier, bitwise-equal to an uninterrupted 3-rank run.
"""

from __future__ import annotations

import shutil
import time

import pytest

from elastictrain.agent.snapshots import snapshot_base
from elastictrain.agent.status import read_nodes
from tests.chaos.cluster import STEPS, Job, Node
from tests.chaos.test_agent_chaos import FAULT_STEP, ON_TWO, WAIT_FOR_REJOIN, _etcd, assert_recovered, events, start_two
from tests.fixtures.pki import OPENSSL, make_pki, needs_openssl
from tests.integration.recipe_runs import assert_same_train_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


# Over mutual TLS where the openssl command can make certificates (CI: tests/must_run.txt), else over plain HTTP: the
# same replica code under both (TLS wraps the socket); the plain transport's own tests are in
# tests/integration/agent/test_replication.py. Both here cost the suite a 2-node chaos run (~1 min on 2 slow cores).
@pytest.fixture(params=[pytest.param("tls", marks=needs_openssl) if OPENSSL else "http"])
def replica_job(request, tmp_path, etcd, run_id):
    """The job, its replicas over mutual TLS (one job-wide certificate, so no host name check), or plain HTTP."""
    tls = ()
    if request.param == "tls":
        (tmp_path / "pki").mkdir()
        pki = make_pki(tmp_path / "pki")
        tls = (f"elastic.replica_tls.cert={pki / 'node-a.pem'}", f"elastic.replica_tls.key={pki / 'node-a.key'}",
               f"elastic.replica_tls.ca={pki / 'ca.pem'}", "elastic.replica_tls.check_hostname=false")
    j = Job(tmp_path, etcd.endpoint, run_id,
            extra_overrides=(*WAIT_FOR_REJOIN, "checkpoint.snapshot_every_steps=1", *tls))
    yield j
    j.teardown()


def test_a_killed_node_resumes_from_its_snapshot_replicated_on_the_peer(replica_job, reference):
    job = replica_job
    a, b = start_two(job)
    saved = job.valid_checkpoints()
    # See test_snapshot_chaos: every rank holds the state with `reached - 1` steps done; b's replica of it is on a
    # within the replication lag (a poll and a transfer of a few hundred KB), far less than the step since.
    reached = job.max_step()
    b.kill()  # agent and workers, no goodbye
    for folder in snapshot_base().glob(f"*-{b.pid}"):
        shutil.rmtree(folder)  # the node's RAM is gone with it (on one machine the folder would outlive it)
    b2 = job.start_node("b-rejoined")
    assert job.wait([a, b2]) == [0, 0], job.logs()
    summary = assert_recovered(job, saved, ON_TWO)
    assert_same_train_state(summary, reference.summary)
    assert summary["resumed_from"].startswith("snapshot:"), summary["resumed_from"]
    assert summary["start_step"] >= reached - 1, (summary["start_step"], reached)
    log = events(job)
    replicated = [e for e in log if e.kind == "checkpoint_snapshot_replicated"]
    holder = next(e.fields["peer"] for e in replicated if e.fields["rank"] == 1)  # where b's rank 1 went first
    loaded = [e for e in log if e.kind == "checkpoint_snapshot_loaded"]
    assert loaded and loaded[-1].fields["step"] == summary["start_step"], loaded
    assert loaded[-1].fields.get("fetched_ranks") == 1 and loaded[-1].fields.get("from_nodes") == [holder], loaded[-1]
    assert not [e for e in log if e.kind == "checkpoint_snapshot_skipped"], "the replica served on the first try"
    if any(o.startswith("elastic.replica_tls") for o in job.overrides):
        assert all("(TLS)" in n.log().split("replica server of node", 1)[1].split("\n", 1)[0] for n in (a, b2)), \
            "every agent's replica server spoke TLS"


def test_two_neighbouring_ring_nodes_lost_fall_back_to_the_durable_checkpoint(tmp_path, etcd, run_id):
    reference = Job(tmp_path / "reference", endpoint="", run_id="reference-3").run_uninterrupted(3)
    job = Job(tmp_path / "job", etcd.endpoint, run_id, nnodes="1:3",
              extra_overrides=(*WAIT_FOR_REJOIN, "checkpoint.snapshot_every_steps=1"))
    try:
        nodes = {name: job.start_node(name) for name in "abc"}
        job.wait_for_step(FAULT_STEP, world_size=3)
        # The ring of this round: each agent announces the peer it replicates to; pick one and that peer.
        ring = _ring(job, nodes)
        lost_rank, src, holder = ring[0]
        survivor = next(n for n in nodes.values() if n not in (src, holder))
        saved = job.valid_checkpoints()
        for node in (src, holder):
            node.kill()  # agent and workers: its snapshots and the replicas it held are gone with it
            for folder in snapshot_base().glob(f"*-{node.pid}"):
                shutil.rmtree(folder)
        back = [job.start_node(f"{node.name}-rejoined") for node in (src, holder)]
        assert job.wait([survivor, *back]) == [0, 0, 0], job.logs()
    finally:
        job.teardown()
    summary = assert_recovered(job, saved, {s: 3 for s in range(STEPS)})
    assert_same_train_state(summary, reference)
    assert not summary["resumed_from"].startswith("snapshot:"), summary["resumed_from"]
    skipped = [e for e in events(job) if e.kind == "checkpoint_snapshot_skipped"]
    assert any(f"rank {lost_rank}: none" in e.fields["reason"] for e in skipped), \
        f"the fallback names rank {lost_rank}, whose only copies were on the two lost nodes: {skipped}"


def _ring(job: Job, nodes: dict[str, Node], timeout: float = 60) -> list[tuple[int, Node, Node]]:
    """(rank, node, the peer holding its replica) for each node of the 3-node round, once each replicated."""
    client, prefix = _etcd(job)
    try:
        deadline = time.monotonic() + timeout
        while True:
            by_name = {n.node: next((x for x in nodes.values() if x.pid == n.agent_pid), None)
                       for n in read_nodes(client, prefix)}
            ring = {}
            for e in events(job):
                src, peer = by_name.get(e.node), by_name.get(e.fields.get("peer"))
                if e.kind == "checkpoint_snapshot_replicated" and src and peer:
                    ring[src.name] = (e.fields["rank"], src, peer)
            if len(ring) == 3 and {peer.name for _, _, peer in ring.values()} == set(ring):
                return list(ring.values())  # a ring of the 3 (an announcement from an earlier round would not be)
            assert time.monotonic() < deadline, f"no replica ring of 3 nodes within {timeout}s: {ring}\n{job.logs()}"
            time.sleep(0.2)
    finally:
        client.close()
