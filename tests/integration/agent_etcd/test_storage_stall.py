"""An S3 server that stalls during an async save: training goes on, the agent sees no hang, later saves commit.

Before: the next due save waited for the stalled upload, so training stopped for as long as the object store
did (and when the "save" heartbeat was lost, the agent read the silence as a hang "in phase 'train'").
One node x 2 workers (`elastictrain run`, etcd), checkpoints every 4 steps to the real S3 server of the session,
stalled (SIGSTOP: it accepts connections, never answers) by the chaos `storage-stall` injector for longer than
the agent's hang floor.
"""

from __future__ import annotations

import time

import pytest

from elastictrain.chaos import injectors
from elastictrain.checkpoint.discovery import list_checkpoints
from elastictrain.checkpoint.storage import open_storage
from elastictrain.runtime.injected_faults import ENV_CHAOS
from tests.chaos.cluster import HANG_FLOOR_S, Job
from tests.integration.agent_etcd.job_records import restarts_and_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EVERY = 4
STALL_S = 3 * HANG_FLOOR_S


def test_s3_stall_during_async_save_neither_blocks_training_nor_reads_as_a_hang(tmp_path, etcd, run_id, s3_bucket):
    job = Job(tmp_path, etcd.endpoint, run_id, steps=80, nnodes="1", ckpt_url=s3_bucket.url,
              extra_overrides=(f"checkpoint.every_steps={EVERY}",))
    # Steps of at least 0.15 s: the stall spans a known number of them on a quiet or a busy machine.
    node = job.start_node("a", {**s3_bucket.server.env(), ENV_CHAOS: "slow@ms=150"},
                          args=["--nproc-per-node", "2", "--no-warm-spares"])
    server = injectors.listening_pid(s3_bucket.server.endpoint_url)
    assert server is not None
    heal = None
    try:
        job.wait_for_step(6, timeout=200)
        _, heal = injectors.stall_process(server, what="S3 server")
        stalled_at = job.max_step()
        time.sleep(STALL_S)
        healed_at = job.max_step()
        heal(), (heal := None)
        codes = job.wait([node], timeout=200)
    finally:
        if heal is not None:
            heal()
        job.teardown()
    assert codes == [0], job.logs()
    assert healed_at >= stalled_at + 2 * EVERY + 1, \
        f"training waited for the stalled save: steps {stalled_at} -> {healed_at} in {STALL_S} s\n{job.logs()}"
    _, events = restarts_and_events(etcd.endpoint, job.run_id)
    kinds = [e.kind for e in events]
    assert "hang" not in kinds and "restart" not in kinds and "failure" not in kinds, kinds
    skipped = [e.fields for e in events if e.kind == "checkpoint_save_skipped"]
    assert skipped, kinds
    stuck = skipped[0]["in_flight_step"]
    assert all(f["in_flight_step"] == stuck and f["step"] > stuck for f in skipped), skipped
    saved = {e.fields["step"] for e in events if e.kind == "checkpoint_saved"}
    assert stuck in saved, "the stalled save completes once the server answers again"
    valid = {c.step for c in list_checkpoints(open_storage(s3_bucket.url, s3_bucket.storage_options())) if c.valid}
    assert {s for s in valid if healed_at < s < 80}, f"no periodic save committed after the stall (valid: {valid})"
