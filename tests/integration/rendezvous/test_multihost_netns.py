"""Multi-host rendezvous: agents in separate network namespaces, etcd in its own, one host cut off.

The namespaces come from `tests.chaos.netns.Fabric`, which follows the network safety rule (blackhole route for
the test subnet first, subnet-only routes, the bridge in a namespace of its own) and cleans up by PID.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastictrain.rendezvous.embedded import EmbeddedEtcd
from tests.chaos.netns import Fabric, netns_unavailable
from tests.integration.rendezvous.launch import Agent, etcd3_args, start_agent, wait_for

HOSTS = ["h1", "h2", "h3"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable())),
]


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    fab = Fabric(HOSTS, services=["etcd"])
    try:
        fab.up()
        yield fab
    finally:
        fab.down()


def test_cutting_one_host_off_leaves_the_others_training(
    fabric: Fabric, tmp_path: Path, run_id: str, record_property
) -> None:
    etcd = EmbeddedEtcd(host=fabric.addr["etcd"], port=2379, peer_port=2380, command_prefix=fabric.prefix("etcd"))
    agents: list[Agent] = []
    try:
        etcd.start()
        args = etcd3_args(etcd.endpoint, run_id)
        for name in HOSTS:
            agents.append(
                start_agent(
                    name, tmp_path, [*args, f"--local-addr={fabric.addr[name]}"], nnodes="2:3",
                    # A long collective timeout: recovery must come from the lease, not from gloo.
                    env={"GLOO_SOCKET_IFNAME": "eth0", "PG_TIMEOUT": "120"}, prefix=fabric.prefix(name),
                )
            )  # fmt: skip
        steps = wait_for(tmp_path, lambda s: sum(x.world == 3 for x in s) >= 9, 120, agents)
        # Cut off the host of global rank 0: with c10d it would also hold the store.
        victim = next(s.tag for s in steps if s.world == 3 and s.rank == 0)
        cut_at = time.time()
        fabric.cut(victim)
        survivors = {n for n in HOSTS if n != victim}
        steps = wait_for(
            tmp_path,
            lambda s: sum(x.world == 2 and x.time > cut_at for x in s) >= 6,
            90,
            agents,
        )
        after = [s for s in steps if s.time > cut_at and s.world == 2]
        assert {s.tag for s in after} == survivors
        # Survivors notice through the lease (ttl 2 s), not the 120 s collective timeout.
        recovery = after[0].time - cut_at
        record_property("recovery_s", round(recovery, 2))
        assert recovery < 25, recovery
    finally:
        for agent in agents:
            for pid in [agent.proc.pid, *agent.descendants()]:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            agent.proc.wait(timeout=10)
        etcd.close()
