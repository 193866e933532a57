"""Fixtures shared by the chaos tests on the recipe (test_agent_chaos, test_snapshot_chaos)."""

from __future__ import annotations

import pytest

from tests.chaos.cluster import STEPS, Job, Reference


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Reference:
    """An uninterrupted run of the recipe's chaos job on 2 ranks (plain torchrun), once per session (a module that
    needs another reference, e.g. of a user's script, defines its own `reference`)."""
    job = Job(tmp_path_factory.mktemp("reference"), endpoint="", run_id="reference")  # the chaos jobs' config
    # Every checkpoint step written, whatever the machine's load: an async save still in flight at the next interval
    # skips that one (seen in CI: no step 8, and two tests that compare with it failed). The content is the same.
    job.overrides.append("checkpoint.async_save=false")
    summary = job.run_uninterrupted(2)
    assert summary["world_size"] == 2 and summary["start_step"] == 0 and summary["final_step"] == STEPS
    return Reference(summary, job.ckpt_url)
