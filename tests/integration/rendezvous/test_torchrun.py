"""Plain `torchrun --rdzv-backend etcd3` with several agents on localhost, real etcd, real gloo workers."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from elastictrain.rendezvous.embedded import free_port
from tests.fixtures.etcd import EtcdHandle
from tests.integration.rendezvous.launch import TORCHRUN, WORKER, Agent, etcd3_args, start_agent, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for agent in started:
        agent.stop()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _since(t: float):
    return lambda steps: [s for s in steps if s.time > t]


def test_two_agents_with_two_workers_each_form_one_group(etcd: EtcdHandle, run_id: str, tmp_path: Path, agents) -> None:
    args = etcd3_args(etcd.endpoint, run_id)
    env = {"TOTAL_STEPS": "15", "STEP_SECONDS": "0.02"}
    agents += [start_agent(t, tmp_path, args, nproc=2, nnodes="2", env=env) for t in ("a", "b")]
    for agent in agents:
        assert agent.proc.wait(timeout=120) == 0, agent.output()[-3000:]
    steps = wait_for(tmp_path, lambda s: len(s) >= 4 * 15, 5, agents)
    assert {s.world for s in steps} == {4}
    assert {s.rank for s in steps} == {0, 1, 2, 3}
    assert max(s.step for s in steps) == 15


def test_job_survives_sigkill_of_the_first_agent_scales_back_up_and_drops_a_lone_agent(
        etcd: EtcdHandle, run_id: str, tmp_path: Path, agents) -> None:
    args = etcd3_args(etcd.endpoint, run_id)
    agents += [start_agent(t, tmp_path, args, nnodes="1:3") for t in ("a", "b", "c")]
    wait_for(tmp_path, lambda s: sum(x.world == 3 for x in s) >= 9, 90, agents)

    # The first agent started: the one torch's c10d backend would have made host the store every
    # node depends on (with etcd3 it also holds rank 0: ranks follow node ids, which start with pids).
    first = agents[0]
    first_tag = first.tag
    killed_at = first.kill_node()
    agents.remove(first)

    steps = wait_for(tmp_path, lambda s: sum(x.world == 2 for x in _since(killed_at)(s)) >= 6, 60, agents)
    after = [s for s in steps if s.time > killed_at and s.world == 2]
    assert {s.tag for s in after} == {a.tag for a in agents}
    recovery = after[0].time - killed_at
    assert recovery < 30, recovery

    rejoin_at = time.time()
    agents.append(start_agent(first_tag, tmp_path, args, nnodes="1:3"))
    steps = wait_for(tmp_path, lambda s: sum(x.world == 3 for x in _since(rejoin_at)(s)) >= 6, 60, agents)
    assert {s.tag for s in steps if s.time > rejoin_at and s.world == 3} == {"a", "b", "c"}
    # The step counter carried on: the group never went back to the beginning.
    assert min(s.step for s in steps if s.time > killed_at) > 1

    # Now kill an agent but not its workers (torchrun puts them in their own session): its lease
    # expires, the others re-form without it, and the orphaned workers fail out of the old group.
    lonely = next(a for a in agents if a.tag != first_tag)
    killed_at, orphans = lonely.kill_agent_only()
    agents.remove(lonely)
    wait_for(tmp_path, lambda s: sum(x.world == 2 for x in _since(killed_at)(s)) >= 4, 60, agents)
    deadline = time.monotonic() + 30
    while any(_running(p) for p in orphans):
        assert time.monotonic() < deadline, "orphaned workers still running"
        time.sleep(0.2)
    lonely.stop()


def test_etcd_outage_of_a_few_seconds_does_not_restart_training(
        etcd_private: EtcdHandle, run_id: str, tmp_path: Path, agents) -> None:
    # The default lease (5 s), as users run it: the tests' 2 s lease can lapse on a loaded machine while the
    # keep-alive reconnects after the outage, and that drop is a different (documented) trade-off.
    args = etcd3_args(etcd_private.endpoint, run_id, lease_ttl=5)
    agents += [start_agent(t, tmp_path, args, nnodes="2") for t in ("a", "b")]
    wait_for(tmp_path, lambda s: len(s) >= 10, 90, agents)
    etcd_private.stop()
    stopped_at = time.time()
    time.sleep(5)
    etcd_private.restart()
    restarted_at = time.time()
    time.sleep(4)
    steps = wait_for(tmp_path, lambda s: any(x.time > restarted_at + 3 for x in s), 20, agents)
    during = [s for s in steps if stopped_at < s.time < restarted_at]
    assert len(during) >= 2 * 20, "training must go on while etcd is down"
    assert {s.restart for s in steps} == {0}, "no worker restart"
    assert {s.world for s in steps} == {2}
    assert all(a.proc.poll() is None for a in agents)


def test_torchrun_with_an_unreachable_endpoint_fails_fast_naming_it(tmp_path: Path, run_id: str) -> None:
    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    start = time.monotonic()
    out = subprocess.run(
        [TORCHRUN, "--nnodes=1", "--rdzv-backend=etcd3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
         "--rdzv-conf=connect_timeout=2", f"--log-dir={tmp_path / 'torchelastic'}", str(WORKER)],
        capture_output=True, text=True, timeout=60, env={"PROGRESS_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode != 0
    assert f"cannot reach etcd at http://{endpoint}" in out.stderr
    assert time.monotonic() - start < 20
