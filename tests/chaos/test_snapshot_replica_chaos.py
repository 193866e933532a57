"""Peer replicas of the in-memory snapshots under a real 2-node `elastictrain run`: node b SIGKILLed (agent and
workers; its snapshot folder, i.e. its RAM, gone with it) and started again with the same command resumes from b's
snapshots as replicated on node a, recomputing at most one completed step, and ends bitwise-equal to an
uninterrupted run.

Without replicas the same fault resumes from the last durable checkpoint (every 4 steps here;
tests/chaos/test_agent_chaos.py::test_a_node_sigkilled_then_one_drained_each_rejoin_by_the_same_command).
"""

from __future__ import annotations

import shutil

import pytest

from elastictrain.agent.snapshots import snapshot_base
from tests.chaos.cluster import Job
from tests.chaos.test_agent_chaos import ON_TWO, WAIT_FOR_REJOIN, assert_recovered, events, start_two
from tests.integration.recipe_runs import assert_same_train_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def replica_job(tmp_path, etcd, run_id):
    j = Job(tmp_path, etcd.endpoint, run_id, extra_overrides=(*WAIT_FOR_REJOIN, "checkpoint.snapshot_every_steps=1"))
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
