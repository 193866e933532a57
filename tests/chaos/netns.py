"""Simulated hosts in network namespaces, joined by one bridge: a reusable `Fabric` for multi-host tests.

Network safety (the project's rule): before anything is created a blackhole route for the test subnet is added
in the root namespace, so nothing from this machine can leak onto a real network; every host or service
namespace gets one address and a route for the test subnet only (no default route); the bridge lives in a
namespace of its own, so no interface of the fabric appears in the root namespace. `down()` kills every process
left in our namespaces (by PID, from `ip netns pids`), deletes the namespaces and removes the blackhole route.

The root namespace cannot reach the subnet (that is the point of the blackhole): probes run inside a namespace
(`reachable`), and state the test needs (sample ledger, checkpoints behind the S3 server) is read from the shared
file system.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

from elastictrain.testing.s3server import S3Server, _rclone_binary

SUBNET_PREFIX = "10.213"
"""Test subnets are 10.213.X.0/24, X picked at random per fabric (a concurrent run holds another X)."""


def netns_unavailable() -> Optional[str]:
    """Why network namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    probe = f"etprobe{uuid.uuid4().hex[:6]}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "`ip netns add` is not permitted here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


class Fabric:
    """A namespace per service and per host, veth pairs to one bridge in a namespace of its own.

    `services` get addresses .2, .3, ...; `hosts` get .11, .12, ... of a random 10.213.X.0/24.
    """

    def __init__(self, hosts: Sequence[str], services: Sequence[str] = ("etcd",)) -> None:
        tag = uuid.uuid4().hex[:6]
        self.names = [*services, *hosts]
        self.hosts = list(hosts)
        self.bridge = f"et{tag}br"
        self.ns = {name: f"et{tag}{name}" for name in self.names}
        self.ports = {name: f"v{tag}{i}" for i, name in enumerate(self.names)}
        self._offsets = {**{s: 2 + i for i, s in enumerate(services)}, **{h: 11 + i for i, h in enumerate(hosts)}}
        self.subnet = ""
        self.addr: dict[str, str] = {}
        self.created: list[str] = []

    def up(self) -> None:
        # The blackhole first: from here on, nothing addressed to the subnet can leave through a real interface.
        # `ip route add` refuses an existing route, so a subnet held by a concurrent run is skipped.
        for octet in random.sample(range(100, 250), 20):
            subnet = f"{SUBNET_PREFIX}.{octet}.0/24"
            if subprocess.run(["ip", "route", "add", "blackhole", subnet], capture_output=True).returncode == 0:
                self.subnet = subnet
                break
        else:
            raise RuntimeError(f"could not add a blackhole route for any {SUBNET_PREFIX}.X.0/24")
        base = self.subnet.rsplit(".", 1)[0]
        self.addr = {name: f"{base}.{off}" for name, off in self._offsets.items()}
        for ns in [self.bridge, *self.ns.values()]:
            _ip("netns", "add", ns)
            self.created.append(ns)
        self._in(self.bridge, "ip", "link", "add", "br0", "type", "bridge")
        self._in(self.bridge, "ip", "link", "set", "br0", "up")
        self._in(self.bridge, "ip", "link", "set", "lo", "up")
        for name, ns in self.ns.items():
            port = self.ports[name]
            # Both ends are created directly inside their namespaces: nothing appears in the root one.
            _ip("link", "add", port, "netns", self.bridge, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._in(self.bridge, "ip", "link", "set", port, "master", "br0")
            self._in(self.bridge, "ip", "link", "set", port, "up")
            self._in(ns, "ip", "link", "set", "lo", "up")
            self._in(ns, "ip", "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")  # the subnet route only
            self._in(ns, "ip", "link", "set", "eth0", "up")

    def _in(self, ns: str, *args: str) -> None:
        _ip("netns", "exec", ns, *args)

    def prefix(self, name: str) -> list[str]:
        """Command prefix that runs a program inside `name`'s namespace (`ip netns exec` execs: same PID)."""
        return ["ip", "netns", "exec", self.ns[name]]

    def cut(self, name: str) -> None:
        """Unplug a host: its bridge port goes down, packets to and from it are dropped."""
        self._in(self.bridge, "ip", "link", "set", self.ports[name], "down")

    def reconnect(self, name: str) -> None:
        """Plug a cut host back in."""
        self._in(self.bridge, "ip", "link", "set", self.ports[name], "up")

    def routes(self, name: str) -> list[str]:
        """The IPv4 routing table of `name`'s namespace, one route a line (`ip route show table all`)."""
        cmd = [*self.prefix(name), "ip", "-4", "route", "show", "table", "all"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=20).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def reachable(self, src: str, dst: str, port: int) -> bool:
        """Whether a TCP connection from `src`'s namespace to `dst`:`port` succeeds (within 2 s)."""
        probe = f"exec 3<>/dev/tcp/{self.addr[dst]}/{port}"
        cmd = [*self.prefix(src), "timeout", "2", "bash", "-c", probe]
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0

    def pids(self, name: str) -> list[int]:
        """PIDs of the processes running in `name`'s namespace."""
        return self._ns_pids(self.ns[name])

    @staticmethod
    def _ns_pids(ns: str) -> list[int]:
        r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
        return [int(p) for p in r.stdout.split()]

    def down(self) -> None:
        """Kill what still runs in our namespaces (by PID), delete them and the blackhole route."""
        for ns in self.created:
            for pid in self._ns_pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in reversed(self.created):
            deadline = time.monotonic() + 10
            while self._ns_pids(ns) and time.monotonic() < deadline:
                time.sleep(0.1)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.created.clear()
        if self.subnet:
            subprocess.run(["ip", "route", "del", "blackhole", self.subnet], capture_output=True, timeout=20)
            self.subnet = ""


class NetnsS3Server(S3Server):
    """`rclone serve s3` inside a fabric namespace, on that namespace's address (the base class binds loopback).

    The backing directory is on the shared file system, so the test reads the bucket directly from disk.
    """

    def __init__(self, fabric: Fabric, name: str = "s3", port: int = 9000, probe_from: Optional[str] = None,
                 **kwargs: Any) -> None:
        super().__init__(port=port, **kwargs)
        self.fabric, self.name = fabric, name
        self.probe_from = probe_from or name
        # Beside the backing directory, not in the shared temp dir (the base class's name holds only the port).
        self._log_path = self.root.rstrip("/") + "-rclone.log"

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.fabric.addr[self.name]}:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self.running and self._proc is not None else None

    def bucket_dir(self, bucket: str) -> Path:
        return Path(self.root) / bucket

    def start(self, timeout_s: float = 20.0) -> "NetnsS3Server":
        if self.running:
            return self
        cmd = [*self.fabric.prefix(self.name), _rclone_binary(), "serve", "s3", self.root,
               "--addr", f"{self.fabric.addr[self.name]}:{self.port}",
               "--auth-key", f"{self.access_key},{self.secret_key}", "--vfs-cache-mode", "off",
               "--config", "/dev/null", "--log-level", "ERROR"]
        with open(self._log_path, "ab") as logf:
            self._proc = subprocess.Popen(cmd, stdout=logf, stderr=logf, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"rclone serve s3 exited with {self._proc.returncode}; see {self._log_path}")
            if self.fabric.reachable(self.probe_from, self.name, self.port):
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"rclone serve s3 did not listen on {self.endpoint_url} within {timeout_s}s")
