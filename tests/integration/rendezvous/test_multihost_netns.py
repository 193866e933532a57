"""Multi-host rendezvous: agents in separate network namespaces, etcd in its own, one host cut off.

Network safety: before creating anything a blackhole route for the test subnet is added in the root
namespace (so nothing from here can leak onto a real network), every host namespace has a route for
the test subnet only (no default route), and the bridge lives in a namespace of its own. Teardown
kills our processes by PID, deletes the namespaces and removes the blackhole route.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastictrain.rendezvous.embedded import EmbeddedEtcd
from tests.integration.rendezvous.launch import Agent, etcd3_args, start_agent, wait_for

SUBNET = "10.213.77.0/24"
ETCD_IP = "10.213.77.2"
HOST_IPS = {"h1": "10.213.77.11", "h2": "10.213.77.12", "h3": "10.213.77.13"}


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    probe = f"etprobe{uuid.uuid4().hex[:6]}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "`ip netns add` is not permitted here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(_netns_unavailable() is not None, reason=str(_netns_unavailable())),
]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def _in(ns: str, *args: str) -> None:
    _ip("netns", "exec", ns, *args)


class Fabric:
    """Namespaces for the bridge, etcd and each host, joined by veth pairs on one bridge."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.bridge = f"et{tag}br"
        self.ns = {name: f"et{tag}{name}" for name in ["etcd", *HOST_IPS]}
        self.ports = {name: f"v{tag}{name}" for name in self.ns}
        self.created: list[str] = []
        self.blackholed = False

    def up(self) -> None:
        _ip("route", "add", "blackhole", SUBNET)
        self.blackholed = True
        for ns in [self.bridge, *self.ns.values()]:
            _ip("netns", "add", ns)
            self.created.append(ns)
        _in(self.bridge, "ip", "link", "add", "br0", "type", "bridge")
        _in(self.bridge, "ip", "link", "set", "br0", "up")
        addrs = {"etcd": ETCD_IP, **HOST_IPS}
        for name, ns in self.ns.items():
            port = self.ports[name]
            # Both ends are created directly inside their namespaces: nothing appears in the root one.
            _ip("link", "add", port, "netns", self.bridge, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _in(self.bridge, "ip", "link", "set", port, "master", "br0")
            _in(self.bridge, "ip", "link", "set", port, "up")
            _in(ns, "ip", "link", "set", "lo", "up")
            _in(ns, "ip", "addr", "add", f"{addrs[name]}/24", "dev", "eth0")  # the subnet route only
            _in(ns, "ip", "link", "set", "eth0", "up")

    def cut(self, name: str) -> None:
        """Unplug a host: its bridge port goes down, packets to and from it are dropped."""
        _in(self.bridge, "ip", "link", "set", self.ports[name], "down")

    def down(self) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        if self.blackholed:
            subprocess.run(["ip", "route", "del", "blackhole", SUBNET], capture_output=True, timeout=20)


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    fab = Fabric()
    try:
        fab.up()
        yield fab
    finally:
        fab.down()


def test_cutting_one_host_off_leaves_the_others_training(
    fabric: Fabric, tmp_path: Path, run_id: str, record_property
) -> None:
    etcd = EmbeddedEtcd(host=ETCD_IP, port=2379, peer_port=2380, command_prefix=["ip", "netns", "exec", fabric.ns["etcd"]])
    agents: list[Agent] = []
    try:
        etcd.start()
        args = etcd3_args(etcd.endpoint, run_id)
        for name, addr in HOST_IPS.items():
            agents.append(
                start_agent(
                    name, tmp_path, [*args, f"--local-addr={addr}"], nnodes="2:3",
                    # A long collective timeout: recovery must come from the lease, not from gloo.
                    env={"GLOO_SOCKET_IFNAME": "eth0", "PG_TIMEOUT": "120"}, prefix=["ip", "netns", "exec", fabric.ns[name]],
                )
            )  # fmt: skip
        steps = wait_for(tmp_path, lambda s: sum(x.world == 3 for x in s) >= 9, 120, agents)
        # Cut off the host of global rank 0: with c10d it would also hold the store.
        victim = next(s.tag for s in steps if s.world == 3 and s.rank == 0)
        cut_at = time.time()
        fabric.cut(victim)
        survivors = {n for n in HOST_IPS if n != victim}
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
