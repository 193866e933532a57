"""launch/slurm.sbatch with the real `elastictrain run` under a fake Slurm: the time-limit signal drains the job.

Two agents (two "nodes" on localhost, one task each, as srun starts them) train against a real etcd; the fake
Slurm (tests/fixtures/slurm.py) delivers the script's own `--signal` as Slurm does: to every process of the step,
agents and workers alike, at the same moment.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from elastictrain.checkpoint.discovery import list_checkpoints
from elastictrain.checkpoint.storage import open_storage
from elastictrain.runtime.audit import read_records
from tests.fixtures.slurm import FakeSlurm, wait_until
from tests.integration.recipe_runs import FAST, REPO, ledger_max_step, worker_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = REPO / "launch" / "slurm.sbatch"


def _ran_on_two_ranks(out: Path, step: int) -> bool:
    samples = out / "samples"
    return samples.exists() and any(r["world_size"] == 2 and r["step"] >= step for r in read_records(samples))


def test_time_limit_signal_drains_every_agent_and_saves_the_last_step(etcd, run_id, tmp_path):
    out = tmp_path / "out"
    overrides = [*FAST, f"train.output_dir={out}", f"checkpoint.url={out}/ckpt", "checkpoint.every_steps=4",
                 "train.steps=100000", "train.audit_samples=true"]
    args = [str(REPO / "configs/tiny-cpu.yaml"), *[a for o in overrides for a in ("--set", o)]]
    env = {**worker_env(), "ETCD": etcd.endpoint, "RUN_ID": run_id, "SLURM_GPUS_PER_NODE": "1"}
    slurm = FakeSlurm(tmp_path / "slurm", path=[Path(sys.executable).parent])
    try:
        slurm.submit(SCRIPT, args, env, tasks=2)
        wait_until(lambda: _ran_on_two_ranks(out, 5) or slurm.batch.poll() is not None, 300,
                   f"step 5 on 2 ranks\n{slurm.output()[-6000:]}")
        assert slurm.batch.poll() is None, slurm.output()[-6000:]
        to_whom = slurm.time_limit_signal(SCRIPT)
        rc = slurm.wait(timeout=180)
        log = slurm.output()
        assert rc == 0, f"the batch script ends with the drained agents' 0 (sent {to_whom}), got {rc}\n{log[-6000:]}"
        assert log.count("node drained on SIGTERM") == 2, f"both agents drained\n{log[-6000:]}"
        saved = [c.step for c in list_checkpoints(open_storage(f"{out}/ckpt")) if c.valid]
        assert max(saved) == ledger_max_step(out) + 1, "the drain saves the last step trained"
    finally:
        slurm.close()
