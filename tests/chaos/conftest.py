"""Fixtures shared by the chaos tests on the recipe (test_agent_chaos, test_snapshot_chaos)."""

from __future__ import annotations

import uuid

import pytest

from tests.chaos.cluster import STEPS, Job, Reference


@pytest.fixture(scope="session")
def reference(tmp_path_factory, _etcd_session_server) -> Reference:
    """An uninterrupted run of the recipe's chaos job on 2 nodes, once per session (a module that needs another
    reference, e.g. of a user's script, defines its own `reference`)."""
    job = Job(tmp_path_factory.mktemp("reference"), _etcd_session_server.endpoint, f"ref-{uuid.uuid4().hex[:8]}")
    try:
        nodes = [job.start_node("a"), job.start_node("b")]
        assert job.wait(nodes) == [0, 0], job.logs()
        summary = job.summary()
        assert summary["world_size"] == 2 and summary["start_step"] == 0 and summary["final_step"] == STEPS
        # A split start (one node alone, the other by scale-up) is no reference.
        job.assert_world_sizes({s: 2 for s in range(STEPS)})
        return Reference(summary, job.ckpt_url)
    finally:
        job.teardown()
