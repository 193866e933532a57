"""A live `elastictrain run` job on this machine as a chaos target.

The job is found the way `elastictrain status` finds it: its etcd endpoint and run id. Each agent publishes its node
status there (host, agent pid, newest step; see :mod:`elastictrain.agent.status`); nodes whose agent runs on this
host and is alive are the targets. The checkpoint URL comes from the job record the agents publish, unless given.

What each kind needs here:

- kill-worker, stop-worker, kill-node, drain-node: a live node on this host (killed and drained nodes are started
  again with the agent's own command line, environment and working directory, output appended to its log).
- partition: not possible (every node shares this machine's loopback); use the network-namespace target.
- restart-etcd: ``etcd_restart_cmd`` (how to start this etcd again with its data); the pid is found from the
  endpoint's port when etcd listens on this machine, else give ``etcd_pid``.
- storage-down, storage-stall: the S3 server of an s3:// checkpoint URL, found from its endpoint's port when it listens
  on this machine, else ``s3_server_pid``; storage-down kills it and starts its command again.
- storage-readonly, storage-full: a directory checkpoint URL and permission to mount (root).
- corrupt-checkpoint: a checkpoint URL (directory or s3:// with its storage options).
"""

from __future__ import annotations

import logging
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from elastictrain.agent.jobstate import DEFAULT_STALE_AFTER_S, JobView, derive
from elastictrain.agent.status import JobRecord, NodeStatus, read_job, read_nodes
from elastictrain.chaos import injectors
from elastictrain.chaos.runner import Injected, UnsupportedFault
from elastictrain.chaos.schedule import ScheduledFault
from elastictrain.checkpoint.storage import endpoint_of, resolve_options
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.settings import EtcdSettings

log = logging.getLogger(__name__)

_LIVE_EXCLUDED = {"succeeded", "left", "failed", "gone", "lost"}

AGENT_COMMANDS = ("elastictrain", "torchrun", "torch.distributed.run")
"""Words one of which an agent's command line holds."""

RELAUNCH_GRACE_S = 60.0
"""After re-launching a node, how long a job with no reporting node still counts as running (not finished)."""


@dataclass
class LocalOptions:
    """What a live job does not publish itself; each field enables the fault kinds that need it."""

    checkpoint_url: Optional[str] = None
    """Default: the URL in the job record the agents publish."""
    storage_options: Optional[dict[str, Any]] = None
    """fsspec options for an s3:// checkpoint URL (endpoint, credentials); default: the job config's."""
    etcd_pid: Optional[int] = None
    etcd_restart_cmd: Optional[str] = None
    s3_server_pid: Optional[int] = None
    relaunch_log: Optional[str] = None
    """Where re-launched agents and servers write; default: the file their stdout went to."""
    stale_after_s: float = DEFAULT_STALE_AFTER_S
    cache_s: float = 0.2
    """Reuse an etcd snapshot for this long (the runner polls several times per poll interval)."""


class LocalTarget:
    """Inject faults into the nodes of a live job whose agents run on this machine."""

    def __init__(self, client: EtcdClient, settings: EtcdSettings, options: Optional[LocalOptions] = None):
        self.client, self.settings = client, settings
        self.options = options or LocalOptions()
        self.hostname = socket.gethostname()
        self._lock = threading.Lock()
        self._snap: Optional[tuple[float, list[NodeStatus], JobView]] = None
        self._job: Optional[JobRecord] = None
        self._relaunching = 0
        self._relaunched_at: Optional[float] = None
        self._told_remote: set[str] = set()

    @property
    def prefix(self) -> str:
        return self.settings.run_prefix

    # ------------------------------------------------------------------ what the runner reads

    def _view(self) -> tuple[list[NodeStatus], JobView]:
        with self._lock:
            now = time.monotonic()
            if self._snap is None or now - self._snap[0] > self.options.cache_s:
                records = read_nodes(self.client, self.prefix)
                view = derive(self.settings.run_id, records, time.time(), stale_after_s=self.options.stale_after_s)
                self._snap = (now, records, view)
            return self._snap[1], self._snap[2]

    def _live(self) -> dict[str, NodeStatus]:
        """Node name -> status of the nodes that are alive (recent status, not ended), on any host."""
        records, view = self._view()
        states = {m.node: m.state for m in view.members}
        return {n.node: n for n in records if states.get(n.node) not in _LIVE_EXCLUDED}

    def _local(self, n: NodeStatus) -> bool:
        return n.host == self.hostname and not injectors.is_gone(n.agent_pid)

    def nodes(self) -> list[str]:
        """Live nodes whose agent runs on this host (others are logged once: run the chaos command there)."""
        out = []
        for name, n in self._live().items():
            if self._local(n):
                out.append(name)
            elif n.host != self.hostname and name not in self._told_remote:
                self._told_remote.add(name)
                log.warning("chaos: node %s runs on host %s, not here (%s): it cannot be targeted from this machine",
                            name, n.host, self.hostname)
        return sorted(out)

    def step(self) -> Optional[int]:
        """The newest step any live node reported (agents publish every 2 s, so it may lag by a few steps)."""
        return self._view()[1].step

    def _done(self) -> bool:
        """The job ended by itself: a node succeeded, or one failed for good (crash loop, spent budget)."""
        _, view = self._view()
        return any(m.state in ("succeeded", "failed") for m in view.members)

    def finished(self) -> bool:
        """The job ended: it succeeded or failed, or every node is gone and none of ours is being started again."""
        if self._done():
            return True
        _, view = self._view()
        with self._lock:
            # A re-launched agent needs a while (imports, rendezvous) before it reports; until then a job whose
            # every node we killed looks dead.
            relaunching = self._relaunching > 0 or (self._relaunched_at is not None and
                                                    time.monotonic() - self._relaunched_at < RELAUNCH_GRACE_S)
        return bool(view.members) and view.state in ("stopped", "failed") and not relaunching

    def job_record(self) -> Optional[JobRecord]:
        if self._job is None:
            self._job = read_job(self.client, self.prefix)
        return self._job

    # ------------------------------------------------------------------ injecting

    def inject(self, fault: ScheduledFault, node: Optional[str], rng: random.Random) -> Injected:
        """Inject one fault (see the module docstring for what each kind needs)."""
        kind = fault.kind
        if kind == "partition":
            raise UnsupportedFault("partition needs nodes on separate networks; every node of a job on this machine "
                                   "shares loopback. Run the job on network-namespace hosts "
                                   "and use the network-namespace chaos target to partition it")
        if kind in ("kill-worker", "stop-worker", "kill-node", "drain-node"):
            agent_pid = self._agent_pid(node)
            if kind == "kill-worker":
                detail, heal = injectors.kill_worker(agent_pid, fault.rank, rng)
            elif kind == "stop-worker":
                detail, heal = injectors.stop_worker(agent_pid, fault.rank, rng)
            else:
                fn = injectors.kill_node if kind == "kill-node" else injectors.drain_node
                detail, heal = fn(agent_pid, log_path=self.options.relaunch_log,
                                  should_relaunch=lambda: not self._done())
                heal = self._counting_relaunch(heal)
            return Injected(fault, node, detail, heal)
        if kind == "restart-etcd":
            detail, heal = self._restart_etcd()
        elif kind in ("storage-down", "storage-stall"):
            pid = self.options.s3_server_pid or self._s3_listener()
            if pid is None:
                raise UnsupportedFault(f"{kind} needs the S3 server's pid (--s3-server-pid) when the checkpoint "
                                       f"URL's endpoint does not listen on this machine; for a directory checkpoint "
                                       f"URL use storage-readonly or storage-full")
            if kind == "storage-down":
                detail, heal = injectors.restart_server(pid, None, sig=signal.SIGKILL, what="S3 server",
                                                        log_path=self.options.relaunch_log)
            else:
                detail, heal = injectors.stall_process(pid, what="S3 server")
        elif kind in ("storage-readonly", "storage-full"):
            url = self.checkpoint_url()
            if "://" in url and not url.startswith("file://"):
                raise UnsupportedFault(f"{kind} needs a directory checkpoint URL, not {url}; for S3 use "
                                       f"storage-down or storage-stall with --s3-server-pid")
            fn = injectors.storage_readonly if kind == "storage-readonly" else injectors.storage_full
            detail, heal = fn(url)
        elif kind == "corrupt-checkpoint":
            detail, heal = injectors.corrupt_checkpoint(self.checkpoint_url(), self.storage_options(), rng)
        else:
            raise UnsupportedFault(f"{kind} is not supported by the local target")
        return Injected(fault, None, detail, heal)

    def _agent_pid(self, node: Optional[str]) -> int:
        live = self._live()
        n = live.get(node or "")
        if n is None:
            known = ", ".join(sorted(live)) or "none"
            raise UnsupportedFault(f"no live node {node!r} in run {self.settings.run_id} (live nodes: {known})")
        if n.host != self.hostname:
            raise UnsupportedFault(f"node {node} runs on host {n.host}; run `elastictrain chaos` there to hit it")
        if injectors.is_gone(n.agent_pid):
            raise UnsupportedFault(f"node {node}'s agent pid {n.agent_pid} is not running on this machine")
        # The pid comes from etcd: make sure it is an agent before signalling it and everything below it.
        cmdline = " ".join(injectors.cmdline_of(n.agent_pid))
        if not any(word in cmdline for word in AGENT_COMMANDS):
            raise UnsupportedFault(f"node {node}'s agent pid {n.agent_pid} runs {cmdline[:80]!r}, not an agent "
                                   f"(pid reused?); not touching it")
        return n.agent_pid

    def _counting_relaunch(self, heal: Optional[injectors.Heal]) -> Optional[injectors.Heal]:
        """Count a node as coming back until its heal ran, so that finished() does not end the run meanwhile."""
        if heal is None:
            return None
        with self._lock:
            self._relaunching += 1
        inner = heal

        def counted() -> Optional[str]:
            try:
                return inner()
            finally:
                with self._lock:
                    self._relaunching -= 1
                    self._relaunched_at = time.monotonic()
                    self._snap = None

        return counted

    def _restart_etcd(self) -> injectors.Result:
        cmd = self.options.etcd_restart_cmd
        if not cmd:
            raise UnsupportedFault("restart-etcd on a live job needs --etcd-restart-cmd 'CMD' (how to start this "
                                   "etcd again with its data directory); it was not started by us")
        pid = self.options.etcd_pid or injectors.listening_pid(self.settings.endpoints_str().split(",")[0])
        if pid is None:
            raise UnsupportedFault(f"no process listens on {self.settings.endpoints_str()} on this machine; pass "
                                   f"--etcd-pid")
        return injectors.restart_server(pid, injectors.shell_restart(cmd, self.options.relaunch_log),
                                        sig=signal.SIGKILL, what="etcd")

    def _s3_listener(self) -> Optional[int]:
        """The S3 server's pid when the job's s3:// checkpoint URL has an endpoint on this machine."""
        try:
            url = self.checkpoint_url()
        except UnsupportedFault:
            return None
        if not url.startswith(("s3://", "s3a://")):
            return None
        endpoint = endpoint_of(resolve_options(url, self.storage_options()))
        return injectors.listening_pid(endpoint) if endpoint else None

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_url(self) -> str:
        url = self.options.checkpoint_url or (self.job_record().checkpoint_url if self.job_record() else None)
        if not url:
            raise UnsupportedFault("the job publishes no checkpoint URL (checkpoint.url unset?); pass "
                                   "--checkpoint-url")
        return url

    def storage_options(self) -> Optional[dict[str, Any]]:
        """The given storage options, else those of the job's config file (when it is readable here)."""
        if self.options.storage_options is not None:
            return self.options.storage_options
        job = self.job_record()
        if job is None or not job.config:
            return None
        try:
            from elastictrain.config import load_config

            return dict(load_config(job.config, []).checkpoint.storage_options) or None
        except Exception as e:  # a config we cannot read here: the URL alone may still do
            log.debug("chaos: could not read storage options from %s: %s", job.config, e)
            return None
