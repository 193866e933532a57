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
import random
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

from elastictrain.chaos import injectors
from elastictrain.chaos.runner import Injected, UnsupportedFault
from elastictrain.chaos.schedule import NODE_KINDS, ScheduledFault
from elastictrain.rendezvous.embedded import EmbeddedEtcd
from tests.chaos.cluster import Job, Node
from tests.chaos.netns import Fabric, NetnsS3Server

log = logging.getLogger(__name__)

WAIT_S = 90.0
"""How long corrupt-checkpoint waits for a new commit before it corrupts the newest one there is."""


@dataclass(frozen=True)
class Corruption:
    """A checkpoint the test corrupted on purpose."""

    step: int
    time: float
    """Wall-clock time of the corruption (worker logs carry wall-clock times)."""


@dataclass
class Outage:
    """A host cut off or a worker stopped by the test, and when (wall clock, as in the agents' logs)."""

    kind: str
    host: str
    start: float
    end: Optional[float] = None


class NetnsTarget:
    """A `ChaosTarget` over the hosts of a `Job` in a `Fabric`, plus its etcd and S3 server."""

    def __init__(self, fabric: Fabric, job: Job, etcd: EmbeddedEtcd, s3: NetnsS3Server, env: dict[str, str],
                 steps: int) -> None:
        self.fabric, self.job, self.etcd, self.s3, self.env, self.steps = fabric, job, etcd, s3, env, steps
        self.current: dict[str, Node] = {}
        self.away: set[str] = set()  # killed, drained or partitioned, until healed
        self.corrupted: list[Corruption] = []
        self.outages: list[Outage] = []
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

    def inject(self, fault: ScheduledFault, node: Optional[str], rng: random.Random) -> Injected:
        kind = fault.kind
        if kind in NODE_KINDS:
            assert node is not None, f"{kind} needs a node"
            return self._inject_node(fault, node, rng)
        if kind == "restart-etcd":
            assert self.etcd.pid is not None, "etcd is not running"
            detail, heal = injectors.restart_server(self.etcd.pid, self._restart_etcd, sig=signal.SIGTERM,
                                                    what="etcd")
        elif kind == "storage-down":
            assert self.s3.pid is not None, "the S3 server is not running"
            detail, heal = injectors.restart_server(self.s3.pid, self._restart_s3, sig=signal.SIGTERM,
                                                    what="S3 server")
        elif kind == "storage-stall":
            assert self.s3.pid is not None, "the S3 server is not running"
            detail, heal = injectors.stall_process(self.s3.pid, what="S3 server")
        elif kind == "corrupt-checkpoint":
            detail, heal = self._corrupt_next_checkpoint(rng), None
        else:
            raise UnsupportedFault(f"{kind} is not simulated in network namespaces (rclone runs as root over a "
                                   f"plain directory); use the local target")
        return Injected(fault, None, detail, heal)

    def _inject_node(self, fault: ScheduledFault, host: str, rng: random.Random) -> Injected:
        agent = self.current[host]
        if fault.kind == "kill-worker":
            detail, heal = injectors.kill_worker(agent.pid, fault.rank, rng)
        elif fault.kind == "stop-worker":
            detail, cont = injectors.stop_worker(agent.pid, fault.rank, rng)
            assert cont is not None
            heal = partial(self._end_outage, self._begin_outage("stop-worker", host), cont)
        elif fault.kind == "kill-node":
            self._leave(host)
            detail, _ = injectors.kill_node(agent.pid, relaunch=False)
            heal = partial(self._rejoin, host)  # the host's own command, tracked as a Node (not a bare re-launch)
        elif fault.kind == "drain-node":
            self._leave(host)
            detail, _ = injectors.drain_node(agent.pid, relaunch=False)
            heal = partial(self._rejoin, host)
        else:  # partition
            self._leave(host)
            self.fabric.cut(host)
            outage = self._begin_outage("partition", host)
            detail = f"bridge port of {host} down"
            heal = partial(self._end_outage, outage, partial(self._reconnect, host))
        return Injected(fault, host, detail, heal)

    # --- helpers ------------------------------------------------------------------------------------------

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

    def _begin_outage(self, kind: str, host: str) -> Outage:
        outage = Outage(kind, host, time.time())
        self.outages.append(outage)
        return outage

    @staticmethod
    def _end_outage(outage: Outage, heal: Callable[[], Optional[str]]) -> Optional[str]:
        outage.end = time.time()
        return heal()

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
        """Wait for the next COMMITTED checkpoint, then corrupt it at once (the newest committed one).

        Corrupting a checkpoint that was just committed leaves the job steps away from the next commit, so the
        fault that follows in the schedule (a kill) makes the job resume while the corrupted one is the newest.
        """
        before = max(self.job.valid_checkpoints(), default=-1)
        deadline = time.monotonic() + WAIT_S
        while max(self.job.valid_checkpoints(), default=-1) <= before:
            if time.monotonic() > deadline or self.finished():
                break
            time.sleep(0.02)
        detail, _ = injectors.corrupt_checkpoint(self.job.ckpt_view, rng=rng)
        found = re.search(r"\(step (\d+)\)$", detail)
        assert found, detail
        self.corrupted.append(Corruption(int(found.group(1)), time.time()))
        return detail
