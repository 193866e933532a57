"""In-memory snapshots (checkpoint.snapshot_every_steps) under a real 2-node `elastictrain run`: a killed worker's
group resumes from the step before the kill, read from node RAM, and ends bitwise-equal to an uninterrupted run.

Without snapshots the same kill resumes from the last durable checkpoint (every 4 steps here) and recomputes up
to 3 steps (tests/chaos/test_agent_chaos.py).
"""

from __future__ import annotations

import pickle
import signal
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from elastictrain.agent.snapshots import snapshot_base
from elastictrain.chaos.process_signals import signal_worker
from elastictrain.checkpoint.manifest import step_dir_name
from tests.chaos.cluster import Job, Reference
from tests.chaos.test_agent_chaos import ON_TWO, assert_recovered, events, start_two
from tests.integration.recipe_runs import assert_same_train_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SNAPSHOTS = ("checkpoint.snapshot_every_steps=1",)


@pytest.fixture
def snapshot_job(tmp_path, etcd, run_id):
    j = Job(tmp_path, etcd.endpoint, run_id, extra_overrides=SNAPSHOTS)
    yield j
    j.teardown()


def checkpoint_contents(url: str, out: Path) -> dict[str, Any]:
    """Everything a (local) durable checkpoint holds, read back in this process (through the file `out`)."""
    dcp_to_torch_save(url.removeprefix("file://"), out)
    return torch.load(out, weights_only=False)


def first_difference(a: Any, b: Any, path: str = "") -> Optional[str]:
    """Where two nested values first differ (tensors bitwise, dtype included), or None when they are the same."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return None if same else path
    if isinstance(a, np.ndarray):
        return None if isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b) else path
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return f"{path} (keys)"
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{path}/{k}")) is not None), None)
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{path} (length)"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{path}[{i}]"))), None)
    if isinstance(a, bytes) and isinstance(b, bytes) and a != b:
        # A pickled value (the RNG states' blob): the same tensors can pickle to other bytes; compare the values.
        try:
            return first_difference(pickle.loads(a), pickle.loads(b), f"{path} (unpickled)")
        except pickle.UnpicklingError:
            return f"{path} (bytes)"
    return None if a == b else f"{path} ({a!r} != {b!r})"


def assert_same_checkpoints(job: Job, reference: Reference, scratch: Path) -> None:
    """The job's durable checkpoints, written from its snapshots, hold exactly what the reference's hold (written
    from the live state by an uninterrupted run) at the same steps."""
    steps = sorted(job.valid_checkpoints() - {0})
    assert steps, "no durable checkpoint was written"
    for step in steps:
        mine = checkpoint_contents(str(Path(job.ckpt_view) / step_dir_name(step)), scratch / f"mine-{step}.pt")
        theirs = checkpoint_contents(reference.checkpoint(step), scratch / f"reference-{step}.pt")
        differs = first_difference(mine, theirs)
        assert differs is None, f"the durable checkpoint of step {step} differs from the reference's at {differs}"


def test_a_killed_worker_resumes_from_the_snapshot_of_the_step_before_the_kill(snapshot_job, reference, tmp_path):
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
    # Durable checkpoints are written from the snapshots (no second copy staged from the live state), before the
    # kill and after the resume, and hold what an uninterrupted run's checkpoints hold.
    assert_same_checkpoints(job, reference, tmp_path)
    assert not [d for d in held if d.exists()], "snapshots left in node RAM after the job ended"
