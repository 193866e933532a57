"""`NetnsTarget`: the chaos runner's target for a job whose nodes are simulated hosts in network namespaces.

Every host runs `elastictrain run` inside its namespace (`tests.chaos.netns.Fabric`); etcd and the S3 server run in
namespaces of their own. Faults act on real processes and links:

| kind | inject | heal |
|---|---|---|
| kill-worker / stop-worker | SIGKILL / SIGSTOP one worker of the host | - / SIGCONT (if the agent has not killed it) |
| kill-node | SIGKILL the agent and its workers | start the host's command again (re-join) |
| drain-node | SIGTERM the agent (it saves and leaves) | wait for it to exit, start it again |
| partition | the host's bridge port goes down | port up; a host whose agent exited is started again |
| restart-etcd | stop etcd (SIGTERM by PID) | start it on the same address and data dir |
| storage-down / storage-stall | stop / SIGSTOP the S3 server | start it on the same address and data / SIGCONT |
| corrupt-checkpoint | flip bytes in a data file of the newest COMMITTED checkpoint | - (the job must skip it) |

`storage-readonly` and `storage-full` are not supported here (rclone runs as root over a plain directory).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from elastictrain.chaos.faults import drain_node, worker_pids
from elastictrain.chaos.runner import Injected, UnsupportedFault
from elastictrain.chaos.schedule import Fault
from elastictrain.checkpoint.discovery import list_checkpoints
from elastictrain.checkpoint.storage import open_storage
from elastictrain.rendezvous.embedded import EmbeddedEtcd
from tests.chaos.cluster import Job, Node
from tests.chaos.netns import Fabric, NetnsS3Server

log = logging.getLogger(__name__)

WAIT_S = 90.0
"""How long an injection waits for what it needs (a live worker, a new checkpoint) before giving up."""


@dataclass(frozen=True)
class Corruption:
    """A checkpoint the test corrupted on purpose."""

    step: int
    file: str
    time: float


class NetnsTarget:
    """A `ChaosTarget` over the hosts of a `Job` in a `Fabric`, plus its etcd and S3 server."""

    def __init__(self, fabric: Fabric, job: Job, etcd: EmbeddedEtcd, s3: NetnsS3Server, env: dict[str, str],
                 steps: int) -> None:
        self.fabric, self.job, self.etcd, self.s3, self.env, self.steps = fabric, job, etcd, s3, env, steps
        self.current: dict[str, Node] = {}
        self.away: set[str] = set()  # killed, drained or partitioned, until healed
        self.corrupted: list[Corruption] = []
        self._lock = threading.Lock()

    # --- hosts --------------------------------------------------------------------------------------------

    def start(self, host: str) -> Node:
        """Start (or re-join with the same command) the host's node inside its namespace."""
        node = self.job.start_node(host, self.env, prefix=self.fabric.prefix(host),
                                   args=["--local-addr", self.fabric.addr[host]])
        self.current[host] = node
        return node

    def start_all(self) -> list[Node]:
        return [self.start(h) for h in self.fabric.hosts]

    # --- ChaosTarget --------------------------------------------------------------------------------------

    def nodes(self) -> list[str]:
        with self._lock:
            return [h for h, n in self.current.items() if h not in self.away and n.alive()]

    def step(self) -> Optional[int]:
        step = self.job.max_step()
        return step if step >= 0 else None

    def finished(self) -> bool:
        if self.job.max_step() >= self.steps - 1:
            return True
        with self._lock:
            return not self.away and not any(n.alive() for n in self.current.values())

    def inject(self, fault: Fault, node: Optional[str], rng: random.Random) -> Injected:
        kind = fault.kind
        if kind in ("kill-worker", "stop-worker"):
            assert node is not None
            rank, pid = self._pick_worker(node, fault.rank, rng)
            if kind == "kill-worker":
                os.kill(pid, signal.SIGKILL)
                return Injected(fault, node, f"SIGKILL worker pid {pid} (rank {rank})", None)
            os.kill(pid, signal.SIGSTOP)
            return Injected(fault, node, f"SIGSTOP worker pid {pid} (rank {rank})",
                            lambda: _signal(pid, signal.SIGCONT, f"worker pid {pid}"))
        if kind == "kill-node":
            assert node is not None
            victim = self._leave(node)
            victim.kill()
            return Injected(fault, node, f"SIGKILL agent pid {victim.pid} and its workers", lambda: self._rejoin(node))
        if kind == "drain-node":
            assert node is not None
            victim = self._leave(node)
            drain_node(victim.pid)
            return Injected(fault, node, f"SIGTERM agent pid {victim.pid}", lambda: self._rejoin(node))
        if kind == "partition":
            assert node is not None
            self._leave(node)
            self.fabric.cut(node)
            return Injected(fault, node, f"bridge port of {node} down", lambda: self._reconnect(node))
        if kind == "restart-etcd":
            pid = self.etcd.pid
            self.etcd.stop()
            return Injected(fault, None, f"etcd pid {pid} stopped", self._restart_etcd)
        if kind == "storage-down":
            pid = self.s3.pid
            self.s3.stop()
            return Injected(fault, None, f"S3 server pid {pid} stopped", self._restart_s3)
        if kind == "storage-stall":
            pid = self.s3.pid
            assert pid is not None, "the S3 server is not running"
            os.kill(pid, signal.SIGSTOP)
            return Injected(fault, None, f"SIGSTOP S3 server pid {pid}",
                            lambda: _signal(pid, signal.SIGCONT, f"S3 server pid {pid}"))
        if kind == "corrupt-checkpoint":
            return Injected(fault, None, self._corrupt_next_checkpoint(rng), None)
        raise UnsupportedFault(f"{kind} is not simulated in network namespaces (rclone runs as root over a plain "
                               f"directory); use the local target")

    # --- helpers ------------------------------------------------------------------------------------------

    def _pick_worker(self, host: str, rank: Optional[int], rng: random.Random) -> tuple[int, int]:
        """(rank, pid) of a live worker of the host: `rank` if it runs there, else a seeded choice."""
        deadline = time.monotonic() + WAIT_S
        while not (pids := worker_pids(self.current[host].pid)):
            if time.monotonic() > deadline or not self.current[host].alive():
                raise RuntimeError(f"{host} has no live worker after {WAIT_S:g}s")
            time.sleep(0.1)
        chosen = rank if rank in pids else rng.choice(sorted(pids))
        return chosen, pids[chosen]

    def _leave(self, host: str) -> Node:
        with self._lock:
            self.away.add(host)
            return self.current[host]

    def _rejoin(self, host: str) -> str:
        old = self.current[host]
        try:
            old.proc.wait(timeout=60)  # a drained node saves and leaves first
        except subprocess.TimeoutExpired:
            old.kill()
        with self._lock:
            new = self.start(host)
            self.away.discard(host)
        return f"agent pid {old.pid} exited with {old.proc.returncode}; started again as pid {new.pid}"

    def _reconnect(self, host: str) -> str:
        self.fabric.reconnect(host)
        with self._lock:
            self.away.discard(host)
            old = self.current[host]
            if old.alive():
                return f"bridge port up; agent pid {old.pid} still running"
            # The agent gave up while cut off: the host re-joins with the same command.
            new = self.start(host)
        return f"bridge port up; agent pid {old.pid} had exited with {old.proc.returncode}, started as pid {new.pid}"

    def _restart_etcd(self) -> str:
        self.etcd.start()
        return f"etcd started again as pid {self.etcd.pid}"

    def _restart_s3(self) -> str:
        self.s3.start()
        return f"S3 server started again as pid {self.s3.pid}"

    def _corrupt_next_checkpoint(self, rng: random.Random) -> str:
        """Wait for the next COMMITTED checkpoint and flip bytes in one of its data files at once.

        Corrupting a checkpoint that was just committed leaves the job steps away from the next commit, so the
        fault that follows in the schedule (a kill) makes the job resume while the corrupted one is the newest.
        """
        root = Path(self.job.ckpt_view)
        before = max(self.job.valid_checkpoints(), default=-1)
        deadline = time.monotonic() + WAIT_S
        while (newest := max(self.job.valid_checkpoints(), default=-1)) <= before:
            if time.monotonic() > deadline or self.finished():
                if newest < 0:
                    raise RuntimeError("no committed checkpoint to corrupt")
                break
            time.sleep(0.02)
        info = next(c for c in list_checkpoints(open_storage(str(root))) if c.step == newest)
        data = sorted(p for p in (root / info.dirname).iterdir() if p.suffix == ".distcp")
        target = rng.choice(data)
        with open(target, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(size // 2)
            chunk = f.read(16)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
            f.flush()
            os.fsync(f.fileno())
        self.corrupted.append(Corruption(newest, str(target), time.time()))
        return f"flipped {len(chunk)} bytes at offset {size // 2} of {target.name} in step {newest}"


def _signal(pid: int, sig: signal.Signals, what: str) -> str:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # e.g. the agent already killed the stopped worker
        return f"{what} was already gone"
    return f"{sig.name} {what}"
