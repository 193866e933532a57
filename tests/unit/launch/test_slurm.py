"""launch/slurm.sbatch under a fake Slurm: the time-limit signal must reach every agent, and the job wait for them.

The agents here are a stand-in `elastictrain` that records its arguments and SIGTERM and then exits 3, so the
test shows whose status the script ends with. tests/integration/launch/test_slurm_drain.py runs the real agent.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.fixtures.slurm import FakeSlurm, signal_directive, wait_until

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "launch" / "slurm.sbatch"

FAKE_AGENT = """#!/usr/bin/env bash
# Stand-in agent: records its arguments, drains on SIGTERM with status 3.
me=$FAKE_SLURM_DIR/agent-$SLURM_PROCID
echo "$*" > "$me.args"
trap 'echo TERM >> "$me.signals"; exit 3' TERM
touch "$me.ready"
while :; do sleep 0.05; done
"""


@pytest.fixture
def slurm(tmp_path: Path):
    fake = FakeSlurm(tmp_path, path=[])
    agent = tmp_path / "bin" / "elastictrain"
    agent.write_text(FAKE_AGENT)
    agent.chmod(0o755)
    yield fake
    fake.close()


def _submit(slurm: FakeSlurm, tmp_path: Path, tasks: int) -> None:
    env = {**os.environ, "FAKE_SLURM_DIR": str(tmp_path), "ETCD": "127.0.0.1:2379", "SLURM_GPUS_PER_NODE": "4"}
    slurm.submit(SCRIPT, ["configs/gpu.yaml", "--set", "train.steps=9"], env, tasks=tasks)
    for i in range(tasks):
        wait_until(lambda i=i: (tmp_path / f"agent-{i}.ready").exists(), 30, f"agent {i} to start\n{slurm.output()}")


def test_time_limit_signal_reaches_every_agent_and_the_job_ends_with_their_status(slurm, tmp_path):
    _submit(slurm, tmp_path, tasks=2)
    to_whom = slurm.time_limit_signal(SCRIPT)
    for i in range(2):
        wait_until(lambda i=i: (tmp_path / f"agent-{i}.signals").exists(), 10,
                   f"agent {i} to receive the time-limit signal (sent: {to_whom}); batch shell exit status "
                   f"{slurm.batch.poll()}\n{slurm.output()}")
    assert slurm.wait(timeout=30) == 3, "the batch script waits for the agents and ends with their status\n" \
                                        + slurm.output()
    assert [(tmp_path / f"agent-{i}.signals").read_text() for i in range(2)] == ["TERM\n"] * 2


def test_the_signal_is_sigterm_to_the_steps_not_to_the_batch_shell():
    assert signal_directive(SCRIPT) == (False, signal.SIGTERM)


def test_agents_get_the_run_id_node_range_gpus_and_extra_arguments(slurm, tmp_path):
    _submit(slurm, tmp_path, tasks=1)
    assert (tmp_path / "agent-0.args").read_text().split() == [
        "run", "--config", "configs/gpu.yaml", "--nnodes", "1:1", "--nproc-per-node", "4",
        "--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-id", "slurm-4242", "--shutdown-timeout", "90",
        "--set", "train.steps=9"]
