"""In-memory snapshots (checkpoint.snapshot_every_steps) under a real 2-node `elastictrain run`: a killed worker's
group resumes from the step before the kill, read from node RAM, and ends bitwise-equal to an uninterrupted run.

Without snapshots the same kill resumes from the last durable checkpoint (every 4 steps here) and recomputes up
to 3 steps (tests/chaos/test_agent_chaos.py).
"""

from __future__ import annotations

import signal

import pytest

from elastictrain.agent.snapshots import snapshot_base
from elastictrain.chaos.process_signals import signal_worker
from tests.chaos.cluster import Job
from tests.chaos.test_agent_chaos import ON_TWO, assert_recovered, events, start_two
from tests.integration.recipe_runs import assert_same_train_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SNAPSHOTS = ("checkpoint.snapshot_every_steps=1",)


@pytest.fixture
def snapshot_job(tmp_path, etcd, run_id):
    j = Job(tmp_path, etcd.endpoint, run_id, extra_overrides=SNAPSHOTS)
    yield j
    j.teardown()


def test_a_killed_worker_resumes_from_the_snapshot_of_the_step_before_the_kill(snapshot_job, reference):
    """...and the agents remove their snapshot folders from node RAM when the job ends."""
    job = snapshot_job
    a, b = start_two(job)
    held = [d for n in (a, b) for d in snapshot_base().glob(f"*-{n.pid}")]
    assert held, "each agent keeps its workers' snapshots in a folder named after its run and pid"
    saved = job.valid_checkpoints()
    # A rank's ledger record of step index k means every rank entered the all_reduce of step index k-1, which
    # each enters after it started its snapshot of the state with k steps done; a rank's copy of the parameters
    # finishes during step k at the latest (its optimizer step waits for it). So every rank holds the state with
    # k-1 steps done, and most likely k.
    reached = job.max_step()
    signal_worker(b.pid, signal.SIGKILL)
    assert job.wait([a, b]) == [0, 0], job.logs()
    summary = assert_recovered(job, saved, ON_TWO)
    assert_same_train_state(summary, reference.summary)
    assert summary["resumed_from"].startswith("snapshot:"), summary["resumed_from"]
    # The newest snapshot every rank holds: the kill came after `reached`; at most one completed step is redone.
    assert summary["start_step"] >= reached - 1, (summary["start_step"], reached)
    loaded = [e for e in events(job) if e.kind == "checkpoint_snapshot_loaded"]
    assert loaded and loaded[-1].fields["step"] == summary["start_step"], loaded
    assert not [d for d in held if d.exists()], "snapshots left in node RAM after the job ended"
