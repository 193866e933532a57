"""Job status and the event log in etcd, written by the agents and read by the operator CLI.

Keys, all under the run's prefix (`/elastictrain/<run_id>`):

    status/nodes/<node>     NodeStatus (JSON), rewritten every `interval_s` by that node's agent. Not bound to a
                            lease: a lost node's record stays, and readers judge it by its age (`updated`).
    status/job              JobRecord (JSON): what every agent knows about the job at start (checkpoint URL,
                            config fingerprint, budget); read by `elastictrain status` and the dashboard.
    events/<t_ns>-<node>    one Event (JSON) per agent event, append-only; keys sort by time.
    restarts/<round>        RestartRecord: the job-wide restart budget (see `budget.py`).
    fatal                   FatalRecord: the worker error that ended the job without a restart.
    committed               the newest committed checkpoint step agents heard of (restart progress).

Publishing never blocks or fails training: `on_event` only queues (it runs on the agent's monitor thread, which
must keep watching workers while etcd is slow or cut off: a partitioned node's agent stalled 9.5 s in etcd writes
of checkpoint events and missed its own workers' failure); the publisher's thread writes events in order and the
node status, logs etcd errors and tries again.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Optional

import psutil

from elastictrain.agent.ledger import FAULT_COST_EVENT, Ledger, for_job
from elastictrain.agent.ledger_file import LedgerKeeper
from elastictrain.rendezvous.client import EtcdClient

if TYPE_CHECKING:
    from elastictrain.agent.agent import ElasticAgent

log = logging.getLogger(__name__)

DEFAULT_STATUS_INTERVAL_S = 2.0
"""How often each agent rewrites its node status."""
LEDGER_CACHE_S = 10.0
"""How long the metrics endpoint reuses the time ledger it read from etcd."""
MAX_QUEUED_EVENTS = 10_000
"""Events kept while etcd cannot be written (a long outage); beyond, the oldest are dropped."""

# event kind -> the node state it leaves behind
_FAULT_KINDS = {"failure", "hang", "restart", "reform", "join", "in_place_resumed"}
"""Events after which this node may have a fault's cost to report (see `_report_faults`)."""
_PROGRESS_KINDS = {"checkpoint_saved", "succeeded"}
"""Events that say the group got further: the moment a fault's recomputation may be over."""
_STATE_AFTER = {"join": "running", "failure": "recovering", "hang": "recovering", "restart": "rendezvous",
                "succeeded": "succeeded", "leave": "left", "drain": "left", "budget_exhausted": "failed",
                "crash_loop": "failed", "no_progress": "failed", "fatal": "failed"}


@dataclass
class WorkerStatus:
    local_rank: int
    pid: int
    step: Optional[int]
    phase: Optional[str]
    heartbeat_age_s: Optional[float]


@dataclass
class NodeStatus:
    node: str
    host: str
    agent_pid: int
    state: str
    group_rank: Optional[int] = None
    world_size: Optional[int] = None
    workers: list[WorkerStatus] = field(default_factory=list)
    step: Optional[int] = None
    step_time_s: Optional[float] = None
    restarts_used: int = 0
    max_restarts: int = 0
    last_event: str = ""
    updated: float = 0.0
    state_since: float = 0.0
    """Unix time at which `state` was entered."""
    snapshot_step: Optional[int] = None
    """The newest in-memory snapshot every local rank holds committed in node RAM (None: snapshots off or none yet)."""
    replicated_step: Optional[int] = None
    """The newest snapshot of every local rank that the ring peer `replica_peer` has confirmed."""
    replica_peer: Optional[str] = None
    stragglers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Ranks of the job named slow now (reported by rank 0, so on its node): global rank -> step (since when),
    lateness_s (seconds late per step), score (that over the step time)."""
    stragglers_replaced: dict[str, int] = field(default_factory=dict)
    """Stragglers of this node this agent replaced (`elastic.replace_stragglers`), per action: restart, drain."""
    last_replacement: Optional[dict[str, Any]] = None
    """The newest of them: slow_rank, action, step, lateness_s, time."""

    @classmethod
    def from_json(cls, data: bytes) -> "NodeStatus":
        raw = _known(cls, json.loads(data))
        raw["workers"] = [WorkerStatus(**_known(WorkerStatus, w)) for w in raw.get("workers", [])]
        return cls(**raw)


@dataclass
class JobRecord:
    """Job-wide facts written by every agent at start (identical on all nodes; the last write wins)."""

    run_id: str
    config: str
    checkpoint_url: Optional[str]
    fingerprint: dict[str, str]
    max_restarts: int
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    steps: int
    started: float
    restart_policy: Optional[dict[str, Any]] = None
    """`RestartPolicy` fields: how `status` judges restarts without progress and their backoff."""

    @classmethod
    def from_json(cls, data: bytes) -> "JobRecord":
        return cls(**_known(cls, json.loads(data)))


def _known(cls: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """Only the fields `cls` knows: a record written by a newer agent still reads."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in raw.items() if k in names}


@dataclass
class Event:
    time: float
    node: str
    kind: str
    fields: dict[str, Any]


def node_name(rdzv_node: Optional[str] = None) -> str:
    """The node's id in status keys: the rendezvous node id when known, else host and agent pid."""
    return rdzv_node or f"{socket.gethostname()}_{os.getpid()}"


class EtcdStatusPublisher:
    """An AgentEventListener that appends events and keeps this node's status fresh in etcd."""

    def __init__(self, client: EtcdClient, run_prefix: str, node: str, *, max_restarts: int = 0,
                 interval_s: float = DEFAULT_STATUS_INTERVAL_S, budget: Any = None):
        self.client, self.prefix, self.node = client, run_prefix.rstrip("/"), node
        self.interval_s = interval_s
        self.budget = budget
        self.status = NodeStatus(node=node, host=socket.gethostname(), agent_pid=os.getpid(), state="starting",
                                 max_restarts=max_restarts, state_since=time.time())
        self._agent: Optional["ElasticAgent"] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._events: deque[tuple[str, Event]] = deque(maxlen=MAX_QUEUED_EVENTS)
        """(etcd key, event), oldest first; the key is taken when the event happens, so keys sort by time."""
        self._thread: Optional[threading.Thread] = None
        self.join_s = 5.0
        """How long `close` waits for the publishing thread (in a write) before its own last flush, and for each of
        the ledger keeper's last rounds."""
        self.snapshot_probe: Optional[Callable[[], tuple[Optional[int], Optional[int], Optional[str]]]] = None
        """(snapshot step, replicated step, replica peer) of this node's snapshot tier, read at each publish."""
        self._faults_open = False
        self._ledger: Optional[Ledger] = None
        self._ledger_at = -1e18
        """A fault may await its `fault_cost` event (set by fault events, cleared once every fault is reported)."""
        self.keeper = LedgerKeeper(_EtcdRecords(self))
        """Keeps the ledger beside the checkpoints while this node is group rank 0 (a full restart continues it)."""
        self.keeper.on_carried = self._reopen_faults

    @property
    def status_key(self) -> str:
        return f"{self.prefix}/status/nodes/{self.node}"

    def attach(self, agent: "ElasticAgent") -> None:
        """Start publishing this agent's worker heartbeats periodically."""
        self._agent = agent
        self._thread = threading.Thread(target=self._loop, name="elastictrain-status", daemon=True)
        self._thread.start()

    def on_event(self, kind: str, fields: dict[str, Any]) -> None:
        """Queue the event and update this node's state; the publisher's thread (or `flush`) writes both."""
        now = time.time()
        ev = Event(time=now, node=self.node, kind=kind, fields={k: v for k, v in fields.items() if k != "time"})
        with self._lock:
            if len(self._events) == self._events.maxlen:
                log.warning("etcd event queue full (%d): dropping the oldest event", len(self._events))
            self._events.append((event_key(self.prefix, self.node), ev))
            state = _STATE_AFTER.get(kind, self.status.state)
            if kind == "leave" and self.status.state in ("succeeded", "failed"):
                state = self.status.state  # how it ended matters more than that it left
            if state != self.status.state:
                self.status.state_since = now
            self.status.state = state
            if kind in _FAULT_KINDS:
                self._faults_open = True
            if not kind.startswith(("checkpoint_", "straggler", FAULT_COST_EVENT)):
                self.status.last_event = kind  # a worker's report is news, not the node's doing
            if kind == "straggler" and isinstance(fields.get("slow_rank"), int):
                keep = ("step", "lateness_s", "score")
                self.status.stragglers[str(fields["slow_rank"])] = {k: fields.get(k) for k in keep}
            elif kind == "straggler_cleared":
                self.status.stragglers.pop(str(fields.get("slow_rank")), None)
            elif kind == "straggler_replaced":
                action = str(fields.get("action"))
                self.status.stragglers_replaced[action] = self.status.stragglers_replaced.get(action, 0) + 1
                self.status.last_replacement = {k: fields.get(k) for k in ("slow_rank", "action", "step", "lateness_s")}
                self.status.last_replacement["time"] = now
            elif kind in ("restart", "join"):
                self.status.stragglers = {}  # a new group: its ranks are judged afresh
            if "group_rank" in fields:
                self.status.group_rank = fields["group_rank"]
            if "world_size" in fields:
                self.status.world_size = fields["world_size"]
        self._wake.set()

    def flush(self) -> None:
        """Write the queued events, then the node status (on the caller's thread); at group rank 0, keep the
        ledger beside the checkpoints (on the keeper's thread: storage never holds this one up)."""
        reported = False
        progressed = self._write_events()
        if progressed and self._faults_open and self.status.group_rank == 0:
            reported = self._report_faults()
            self._write_events()  # now: the last flush (close) has no later round
        self.publish()
        if self.status.group_rank == 0:
            self.keeper.poke(soon=progressed or reported)

    def _reopen_faults(self) -> None:
        """The ledger carried from a full restart's file holds a fault (the restart) whose cost is still to report."""
        with self._lock:
            self._faults_open = True

    def _write_events(self) -> bool:
        """Write the queued events in order until etcd fails; True if one said the group got further."""
        progressed = False
        while True:
            with self._lock:
                if not self._events:
                    return progressed
                key, ev = self._events[0]
            try:
                self.client.put(key, _encoded(ev))
            except Exception as e:  # etcd down: keep it for the next round
                log.warning("could not record %s event in etcd (will retry): %s", ev.kind, e)
                return progressed
            with self._lock:
                self._events.popleft()
            if ev.kind == "checkpoint_saved" and self.budget is not None and isinstance(ev.fields.get("step"), int):
                self.budget.note_committed(ev.fields["step"])  # what the restart policy calls progress
            progressed = progressed or ev.kind in _PROGRESS_KINDS

    def _report_faults(self) -> bool:
        """One `fault_cost` event per fault whose cost is final (its steps recomputed), written once, by the node of
        group rank 0: the time ledger (`ledger.py`) over the job's records in etcd, as every reader computes it."""
        try:
            events = read_events(self.client, self.prefix)
            restarts = self.budget.records() if self.budget is not None else []
            led = for_job(events, restarts, read_job(self.client, self.prefix),
                          read_nodes(self.client, self.prefix), time.time())
        except Exception as e:  # etcd down: the next save tries again
            log.debug("could not read the job's records for its fault costs: %s", e)
            return False
        reported = {round(e.fields.get("fault_at", 0.0), 3) for e in events if e.kind == FAULT_COST_EVENT}
        still_open = wrote = False
        for f in led.faults[led.carried_faults:]:  # (a carried ledger's faults were reported in their own etcd)
            if round(f.at, 3) in reported:
                continue
            if not f.complete:
                still_open = True
                continue
            fields = f.to_dict()
            fields["fault_at"] = fields.pop("at")
            self.on_event(FAULT_COST_EVENT, {**fields, "ettr": led.ettr})
            wrote = True
        self._faults_open = still_open
        return wrote

    def publish(self) -> None:
        with self._lock:
            st = self.status
            if self._agent is not None:
                now = time.monotonic()
                health = self._agent.worker_health()
                st.workers = [WorkerStatus(local_rank=lr, pid=w.pid, step=w.step, phase=w.phase,
                                           heartbeat_age_s=None if w.last_beat is None else round(now - w.last_beat, 3))
                              for lr, w in sorted(health.items())]
                steps = [w.step for w in st.workers if w.step is not None]
                st.step = max(steps) if steps else None
                st.step_time_s = self._agent.step_time()
            if self.budget is not None:
                st.restarts_used = self.budget.used(tolerant=True)
            if self.snapshot_probe is not None:
                st.snapshot_step, st.replicated_step, st.replica_peer = self.snapshot_probe()
            st.updated = time.time()
            payload = json.dumps(asdict(st), default=str).encode()
        try:
            self.client.put(self.status_key, payload)
        except Exception as e:
            log.debug("status publish failed: %s", e)

    def ledger(self) -> Optional[Ledger]:
        """The job's time ledger from etcd (for the metrics endpoint), read at most every `LEDGER_CACHE_S`."""
        with self._lock:
            if time.monotonic() - self._ledger_at < LEDGER_CACHE_S:
                return self._ledger
        try:
            got = for_job(read_events(self.client, self.prefix),
                          self.budget.records() if self.budget is not None else [],
                          read_job(self.client, self.prefix), read_nodes(self.client, self.prefix), time.time())
        except Exception as e:  # etcd down: the last one, the scrape still answers
            log.debug("could not read the job's time ledger: %s", e)
            return self._ledger
        with self._lock:
            self._ledger, self._ledger_at = got, time.monotonic()
        return got

    def snapshot(self) -> NodeStatus:
        """A copy of the last published status (for the metrics endpoint)."""
        with self._lock:
            return NodeStatus.from_json(json.dumps(asdict(self.status), default=str).encode())

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.join_s)
        self.flush()
        if self.status.group_rank == 0:
            self.keeper.close(timeout=self.join_s)


class _EtcdRecords:
    """The job's records as the ledger keeper (`ledger_file.py`) reads them: through this node's publisher."""

    def __init__(self, pub: EtcdStatusPublisher):
        self.pub = pub

    def job(self) -> Optional[JobRecord]:
        return read_job(self.pub.client, self.pub.prefix)

    def events(self) -> list[Event]:
        return read_events(self.pub.client, self.pub.prefix)

    def ledger(self, events: list[Event], job: Optional[JobRecord]) -> Ledger:
        restarts = self.pub.budget.records() if self.pub.budget is not None else []
        return for_job(events, restarts, job, read_nodes(self.pub.client, self.pub.prefix), time.time())

    def append(self, kind: str, fields: dict[str, Any]) -> None:
        """Written now, not queued: the keeper writes nothing to storage before its carry is in etcd."""
        ev = Event(time=time.time(), node=self.pub.node, kind=kind, fields=fields)
        self.pub.client.put(event_key(self.pub.prefix, self.pub.node), _encoded(ev))


def event_key(run_prefix: str, node: str) -> str:
    """`events/<t_ns>-<node>`: append-only, sorted by time."""
    return f"{run_prefix}/events/{time.time_ns():020d}-{node}"


def _encoded(ev: Event) -> bytes:
    return json.dumps(asdict(ev), default=str).encode()


def read_nodes(client: EtcdClient, run_prefix: str) -> list[NodeStatus]:
    raw = client.get_prefix(f"{run_prefix.rstrip('/')}/status/nodes/")
    return sorted((NodeStatus.from_json(v) for v in raw.values()), key=lambda s: s.node)


def peer_step_times(nodes: list[NodeStatus], this_node: str) -> dict[int, float]:
    """World size -> the median calibrated step time the other nodes published for it (a re-started agent's prior:
    the calibration outlives the agent process)."""
    seen: dict[int, list[float]] = {}
    for n in nodes:
        if n.node != this_node and n.world_size and n.step_time_s:
            seen.setdefault(n.world_size, []).append(n.step_time_s)
    return {w: sorted(v)[len(v) // 2] for w, v in seen.items()}


def read_events(client: EtcdClient, run_prefix: str, since: float = 0.0) -> list[Event]:
    raw = client.get_prefix(f"{run_prefix.rstrip('/')}/events/")
    out = [Event(**json.loads(v)) for _, v in sorted(raw.items())]
    return [e for e in out if e.time >= since]


def job_key(run_prefix: str) -> str:
    return f"{run_prefix.rstrip('/')}/status/job"


def publish_job(client: EtcdClient, run_prefix: str, record: JobRecord) -> None:
    """Write the job record; an etcd error is logged, never raised (status is best effort).

    `started` stays the earliest any agent of the same job wrote: a node that re-joins (or a whole job started
    again with the same run id and config) continues the job, whose wall time the time ledger counts from there."""
    try:
        record = replace(record, started=min(record.started, _process_started()))
        got = client.get(job_key(run_prefix))
        if got is not None:
            old = JobRecord.from_json(got[0])
            if old.fingerprint == record.fingerprint and old.steps == record.steps and old.started < record.started:
                record = replace(record, started=old.started)
        client.put(job_key(run_prefix), json.dumps(asdict(record)).encode())
    except Exception as e:
        log.warning("could not publish the job record to etcd: %s", e)


def process_started(pid: int) -> float:
    """When process `pid` started, on the wall clock to a clock tick (Linux): its start in ticks since boot
    (/proc/<pid>/stat) moved by the boot clock's offset now. Not psutil's `create_time`: it adds those ticks to the
    boot time of /proc/stat, which is whole seconds, so it can be up to 1 s early (0.75 s on one CI machine, which put
    the ledger's start before the job was launched). Raises OSError where /proc or the boot clock is missing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime; the name may hold spaces
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (ValueError, IndexError, AttributeError) as e:
        raise OSError(f"no start time for process {pid}: {e}") from e
    return time.time() - max(0.0, age)


@functools.lru_cache(maxsize=1)
def _process_started() -> float:
    """When this agent's process started: the job began then, not once its imports were done. Computed once: the
    wall and boot clocks are read a few microseconds apart, and a job record published again by this agent must keep
    the same start."""
    try:
        return process_started(os.getpid())
    except OSError:
        pass
    try:
        return float(psutil.Process(os.getpid()).create_time())
    except psutil.Error:  # unreadable: the caller's time
        return float("inf")


def read_job(client: EtcdClient, run_prefix: str) -> Optional[JobRecord]:
    got = client.get(job_key(run_prefix))
    return None if got is None else JobRecord.from_json(got[0])
