"""Pause in place (`elastic.in_place`): a failed rank's peers keep their processes and state, and only it is replaced.

When a rank dies, its peers' collectives fail ("Connection reset by peer": gloo tells every rank connected to the
dead one, and a rank that tears its group down tells the rest). Instead of exiting, a survivor's step loop
(`runtime/steps.py`, inside `Worker.guard()`) drops the partial step and waits at the step boundary, reporting
phase `paused`, while the failed rank's agent starts a replacement (a warm spare) for it. Then every rank builds a
new default process group for the next **generation**, its c10d store on etcd (no worker hosts it, so the dead rank
may have been rank 0), points FSDP at it, and loads the newest snapshot every rank holds: the survivors from their
own node's memory, the replacement from the same node's snapshot (or a peer's replica).

The generations are a counter in etcd (`<run>/inplace/gen`). The agent that replaces a rank bumps it and tells the
replacement which generation to join (`ENV_GENERATION`); survivors wait for the counter to pass the generation they
run in. Anything that goes wrong on this path (no new generation within `timeout_s`, a group that does not form)
makes the survivor exit with `EXIT_NO_IN_PLACE`, and the agents fall back to restarting every worker.

Workers learn the etcd endpoint from `ENV_IN_PLACE`, set by our agent; without it this module is idle.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from elastictrain.errors import ElastictrainError
from elastictrain.rendezvous.shrink import ENV_ROUND, ENV_ROUND_RANK, Shrinks, World

log = logging.getLogger(__name__)

ENV_IN_PLACE = "ELASTICTRAIN_IN_PLACE"
"""JSON `InPlaceSettings`, set by the agent for its workers when `elastic.in_place` is on."""
ENV_GENERATION = "ELASTICTRAIN_IN_PLACE_GENERATION"
"""Set on a replacement worker: the process-group generation it joins."""
GENERATIONS_PREFIX = "inplace"
"""Under the run's etcd prefix: the generation counter (`gen`) and each generation's c10d store (`g<N>/`)."""
_POLL_S = 0.05
_NODES_POLL_S = 0.25
_WATCH_S = 0.5
GROW_SAVE_WAIT_S = 30.0
"""The longest a grow waits for the durable saves in flight to finish before the group stops to re-form anyway."""
READY = "ready"
"""Under a generation's keys: `ready/<rank>`, put by each new worker before it joins that generation's group."""
_SHRINK_WAIT_S = 15.0
"""After a node left: how long a paused worker waits for its agents to decide (a smaller world, a new round)."""

_PEER_FAILURE_MARKERS = ("connection reset by peer", "connection closed by peer", "broken pipe", "socket closed",
                         "pair.cc", "nccl", "timed out", "timeout", "abort")


class InPlaceFailed(ElastictrainError):
    """The in-place path could not continue; the worker exits for a restart of every worker instead."""


class WorldShrank(InPlaceFailed):
    """The world shrank in place, and this script cannot build its model on the new mesh (no `rebuild`): the worker
    exits for a re-form in a new round, free of charge like a drain's (`EXIT_REFORM`): nothing failed, and the state
    is in the snapshots."""


@dataclass(frozen=True)
class InPlaceSettings:
    """How a worker reaches the run's generations in etcd (the agent's rendezvous settings) and how long it waits."""

    endpoint: str
    run_id: str
    conf: dict[str, Any] = field(default_factory=dict)
    """torchrun's --rdzv-conf (TLS files, credentials, key prefix): the same etcd access the agent has."""
    timeout_s: float = 60.0
    """The longest a survivor waits for the replaced rank's generation before it gives up on the in-place path."""
    rejoin_s: float = 0.0
    """`elastic.rejoin_wait_s`: how long a lost node's place is held for a new node to take over in place
    (rendezvous/vacancy.py); 0: a lost node ends the in-place path at once (unless `shrink`)."""
    shrink: bool = False
    """`elastic.in_place_shrink`: a lost node nobody replaces is dropped and the survivors go on as a smaller world
    (rendezvous/shrink.py), which a paused worker waits for instead of giving up."""

    def to_env(self) -> str:
        return json.dumps(asdict(self), default=str)

    @classmethod
    def from_env(cls) -> Optional["InPlaceSettings"]:
        raw = os.environ.get(ENV_IN_PLACE)
        if not raw:
            return None
        data = json.loads(raw)
        return cls(str(data["endpoint"]), str(data["run_id"]), dict(data.get("conf") or {}),
                   float(data.get("timeout_s", 60.0)), float(data.get("rejoin_s", 0.0)), bool(data.get("shrink")))


def generations_store(client: Any, run_prefix: str) -> dist.Store:
    """The run's generation counter and per-generation stores, on etcd (`rendezvous.store.EtcdStore`)."""
    from elastictrain.rendezvous.store import EtcdStore

    return EtcdStore(client, f"{run_prefix}/{GENERATIONS_PREFIX}", timeout=datetime.timedelta(seconds=60))


FORMED = "formed"
"""Under the run's generations store: `formed/<generation>`, written once the survivors of a grow re-formed the bigger
world of that generation with its new workers (or, when its only survivor failed first, once its replacement formed
it: steps_inplace.py `_record_formed_without_survivors`). Until then the grow's new workers wait in that generation's
group: an agent replacing a failed worker starts the replacement in that generation, not a newer one (agent.py
`_replace_in_place`)."""


def record_formed(store: dist.Store, generation: int) -> None:
    store.set(f"{FORMED}/{generation}", b"1")


def formed(store: dist.Store, generation: int) -> bool:
    return bool(store.check([f"{FORMED}/{generation}"]))


ENTERED = "entered"
"""Under the run's generations store: `entered/<generation>`, written by a survivor before it enters a grow's group
(`Worker.rebuild_group`) and by a new or replacement worker once that group formed (`Session.join`). A failure while
the grow has not formed is replaced into the grow's generation only while no one entered it: after that, that group
may exist without the failed rank, and a replacement joining it would find stale peers (seen in goodput.py at 50M: the
only survivor killed 2 s into the grow's restore, its replacement stalled 31.7 s); every worker is restarted then."""


def record_entered(store: dist.Store, generation: int) -> None:
    store.set(f"{ENTERED}/{generation}", b"1")


def entered(store: dist.Store, generation: int) -> bool:
    return bool(store.check([f"{ENTERED}/{generation}"]))


def current_generation(store: dist.Store) -> int:
    return int(store.add("gen", 0))


def next_generation(store: dist.Store) -> int:
    """Start a new generation (the agent replacing a rank); its number."""
    return int(store.add("gen", 1))


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` says a collective failed because a peer went away (not a bug in the step's own code)."""
    if isinstance(exc, (dist.DistNetworkError, dist.DistBackendError, dist.DistStoreError)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(m in text for m in _PEER_FAILURE_MARKERS)
    return False


class InPlace:
    """The worker's side of the in-place path: its generation, waiting for the next one, rebuilding the group."""

    def __init__(self, settings: InPlaceSettings, rank: int, world_size: int):
        self.settings, self.rank, self.world_size = settings, rank, world_size
        joined = os.environ.get(ENV_GENERATION)
        self._generation: Optional[int] = int(joined) if joined else None
        self._generation_nodes: Optional[set[str]] = None
        self.replacement = joined is not None
        self.round = int(os.environ.get(ENV_ROUND, "-1"))
        """The rendezvous round this worker's group formed in (set by the agent; -1: unknown, no shrink)."""
        self.round_rank = int(os.environ.get(ENV_ROUND_RANK, rank))
        """This worker's global rank when its round formed: its name in the round's shrinks (rendezvous/shrink.py)."""
        self._client: Any = None
        self._store: Optional[dist.Store] = None
        self._prefix = self._run_prefix = ""
        self.grow_ready: Optional[int] = None
        """Set by `StuckWatch`: the generation of a bigger world whose new workers wait for this group (a node took a
        lost node's place back, rendezvous/shrink.py); the step loop re-forms at its next step boundary."""
        self.grow_ready_at = 0.0
        """When `grow_ready` was set (monotonic): a re-form waits for a durable save in flight, but not forever."""

    @property
    def generation(self) -> Optional[int]:
        """The generation this process runs in; None until known (a first start reads it at its loop's start)."""
        return self._generation

    @generation.setter
    def generation(self, value: int) -> None:
        """Also note the job's live nodes as this generation starts: a node lost later is told from them (the
        presence links can revoke its lease before this worker even sees its collective fail; `wait_next`)."""
        self._generation = value
        try:
            self._generation_nodes = self._nodes()
        except Exception as e:  # noqa: BLE001 - etcd errors come in several types; `wait_next` reads them then
            log.debug("could not read the job's nodes at generation %d: %s", value, e)
            self._generation_nodes = None

    @classmethod
    def from_env(cls, rank: int, world_size: int) -> Optional["InPlace"]:
        settings = InPlaceSettings.from_env()
        return cls(settings, rank, world_size) if settings is not None else None

    @property
    def store(self) -> dist.Store:
        if self._store is None:
            from elastictrain.rendezvous.client import EtcdClient
            from elastictrain.rendezvous.settings import EtcdSettings

            s = self.settings
            etcd = EtcdSettings.from_conf(s.endpoint, s.run_id, s.conf)
            self._client = EtcdClient(etcd)
            self._client.connect()
            self._run_prefix = etcd.run_prefix
            self._prefix = f"{etcd.run_prefix}/{GENERATIONS_PREFIX}"
            self._store = generations_store(self._client, etcd.run_prefix)
        return self._store

    def service_ports(self) -> set[int]:
        """Ports this worker talks to besides its group's peers (etcd, the first group's TCPStore): never shut down
        at a pause (`shut_group_sockets`)."""
        from elastictrain.rendezvous.settings import parse_endpoints

        ports = {e.port for e in parse_endpoints(self.settings.endpoint)}
        if os.environ.get("MASTER_PORT", "").isdigit():
            ports.add(int(os.environ["MASTER_PORT"]))
        return ports

    def group_store(self, generation: int) -> dist.Store:
        """The c10d store generation `generation`'s default group forms on."""
        return dist.PrefixStore(f"g{generation}", self.store)

    def read_generation(self) -> int:
        return current_generation(self.store)

    def recorded(self, generation: int) -> bool:
        """Whether the world this worker's round runs in at `generation` is recorded in full. A shrink or a grow moves
        the generation counter first and writes the new world's record right after (rendezvous/shrink.py: the record
        names every node lost before it only so); a worker that read the counter in between took the old world for
        the new generation's, joined a group that waited for a lost rank, and hung there with its peer (seen in the
        3-node chaos test and in a 2-node one). The round's `gone/` keys are written before the counter moves (and a
        grow deletes its node's before), so the newest record matches them once it is written."""
        if not self.settings.shrink or self.round < 0:
            return True
        world = self.world_at(generation)  # connects
        return set(world.gone if world is not None else ()) == Shrinks(self._client, self._run_prefix).gone(self.round)

    def world_at(self, generation: int) -> Optional[World]:
        """The smaller world this worker's round runs in at `generation`, when it shrank in place; else None."""
        if not self.settings.shrink or self.round < 0:
            return None
        self.store  # noqa: B018 - connects
        return Shrinks(self._client, self._run_prefix).world(self.round, generation)

    def place(self, generation: int) -> Optional[tuple[int, int]]:
        """This worker's rank and world size at `generation` when its round shrank (or grew back) in place by then;
        None when it did not. Raises `InPlaceFailed` when this worker is not in that world."""
        world = self.world_at(generation)
        if world is None:
            return None
        rank = world.rank_of(self.round_rank)
        if rank is None:
            raise InPlaceFailed(f"this worker (round rank {self.round_rank}) is not in the world of generation "
                                f"{generation}; restarting every worker instead")
        return rank, world.size

    def mark_ready(self, generation: int) -> None:
        """A new worker is about to join generation `generation`'s group: the survivors of a grow wait for this
        before they stop training to re-form with it (`StuckWatch`)."""
        self.store  # noqa: B018 - connects
        self._client.put(f"{self._prefix}/g{generation}/{READY}/{self.rank}", b"1")

    def mark_entered(self, generation: int) -> None:
        """This worker enters (a survivor) or formed (a new worker) generation `generation`'s group: from now on a
        failure before the grow is recorded formed restarts every worker (`ENTERED`). Raises `InPlaceFailed` when
        etcd cannot take it (the agents could otherwise replace a rank into a group that exists without it)."""
        try:
            record_entered(self.store, generation)
        except Exception as e:  # noqa: BLE001 - etcd errors come in several types
            raise InPlaceFailed(f"could not record in etcd that generation {generation}'s group is entered ({e}); "
                                f"restarting every worker instead") from e

    def wait_next(self, beat: Callable[[], None], stop: Callable[[], bool]) -> int:
        """Wait until the agent of the failed rank started a newer generation than ours; its number.

        `beat` keeps the agent's hang detector informed; `stop` (SIGTERM: the agents chose a full restart) ends the
        wait. A node of the job that loses its etcd lease meanwhile (a lost node: no agent replaces its ranks) ends
        it too, unless its place is held for a new node (`rejoin_s`): then the wait lasts until that node's generation
        comes or the agents give up on it (a SIGTERM). Raises `InPlaceFailed` when it ends, and after `timeout_s`.
        """
        assert self.generation is not None, "the loop reads the generation at its start"
        deadline = time.monotonic() + self.settings.timeout_s
        # The nodes as the generation started, not as the wait starts: a dead node's lease can be revoked (presence
        # links) before this worker saw its collective fail, and a node already gone would never count as lost.
        nodes = self._generation_nodes if self._generation_nodes is not None else self._nodes()
        checked = time.monotonic()
        while True:
            newest = self.read_generation()
            if newest > self.generation and self.recorded(newest):
                return newest
            if stop():
                raise InPlaceFailed("stopped while paused in place (the agents restart every worker)")
            if time.monotonic() - checked >= _NODES_POLL_S:
                checked = time.monotonic()
                lost = sorted(nodes - self._nodes())
                if lost and self.settings.rejoin_s <= 0 and not self.settings.shrink:
                    raise InPlaceFailed(f"node(s) {', '.join(lost)} left the job while paused in place; "
                                        f"restarting every worker instead")
                if lost and self.settings.rejoin_s <= 0:  # the agents drop it: wait for the smaller world
                    log.warning("node(s) %s left the job while paused in place; waiting for the survivors to go on "
                                "without them (elastic.in_place_shrink)", ", ".join(lost))
                    nodes -= set(lost)
                    deadline = max(deadline, time.monotonic() + _SHRINK_WAIT_S)
                elif lost:  # its place is held: wait for the node that takes it over (or for the agents' SIGTERM)
                    log.warning("node(s) %s left the job while paused in place; waiting up to %.0f s for a node to "
                                "take over (elastic.rejoin_wait_s)", ", ".join(lost), self.settings.rejoin_s)
                    nodes -= set(lost)
                    deadline = max(deadline, time.monotonic() + self.settings.rejoin_s + _SHRINK_WAIT_S)
            if time.monotonic() >= deadline:
                raise InPlaceFailed(f"no replacement joined within {self.settings.timeout_s:g} s "
                                    f"(elastic.in_place_timeout_s); restarting every worker instead")
            beat()
            time.sleep(_POLL_S)

    def _nodes(self) -> set[str]:
        """The job's live nodes: their lease-bound records (rendezvous/liveness.py)."""
        self.store  # noqa: B018 - connects
        prefix = f"{self._run_prefix}/nodes/"
        return {k.removeprefix(prefix) for k in self._client.get_prefix(prefix)}

    def forget(self, generation: int) -> None:
        """Drop an old generation's store keys (rank 0, best effort)."""
        if self._client is None:
            return
        try:  # the counter stays; only that group's rendezvous keys go
            self._client.delete_prefix(f"{self._prefix}/g{generation}/")
        except Exception as e:  # noqa: BLE001 - a few stale keys under the run's prefix harm nothing
            log.debug("could not delete generation %d's store keys: %s", generation, e)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
            self._store = None


class StuckWatch:
    """A survivor that cannot pause: the job moved to a newer generation (a peer was replaced) while this process
    stayed inside a collective that never failed (seen with gloo at 150M parameters: the dead peer's connections
    were closed, yet the main thread waited on for minutes). After `grace()` seconds of that it exits with
    `EXIT_NO_IN_PLACE`, so its agent restarts every worker at once instead of waiting for two hang timeouts.

    A newer generation that grows this worker's round back (rendezvous/shrink.py) is no failure: the watch tells the
    step loop once every new worker of it is ready (`InPlace.grow_ready`), and counts the grace from then."""

    def __init__(self, in_place: InPlace, pausing: Callable[[], bool], grace: Callable[[], float],
                 exit: Callable[[int], None] = os._exit):
        self._in_place, self._pausing, self._grace, self._exit = in_place, pausing, grace, exit
        self._stop = threading.Event()
        self._client: Any = None
        self._thread = threading.Thread(target=self._run, name="elastictrain-in-place-watch", daemon=True)

    def start(self) -> "StuckWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _newest(self) -> int:
        if self._client is None:  # its own connection: the main thread uses the other one while it waits
            from elastictrain.rendezvous.client import EtcdClient
            from elastictrain.rendezvous.settings import EtcdSettings

            s = self._in_place.settings
            self._client = EtcdClient(EtcdSettings.from_conf(s.endpoint, s.run_id, s.conf))
            self._client.connect()
        found = self._client.get(f"{self._client.settings.run_prefix}/{GENERATIONS_PREFIX}/gen")
        return int(found[0]) if found is not None else 0

    def _grow(self, generation: int) -> Optional[bool]:
        """None: `generation` does not grow this worker's round; else whether all its new workers are ready."""
        ip = self._in_place
        if not ip.settings.shrink or ip.round < 0:
            return None
        prefix = self._client.settings.run_prefix
        world = Shrinks(self._client, prefix).world(ip.round, generation)
        if world is None or world.generation != generation or not world.joined or \
                world.rank_of(ip.round_rank) is None:
            return None
        ready = self._client.get_prefix(f"{prefix}/{GENERATIONS_PREFIX}/g{generation}/{READY}/")
        wanted = {f"{prefix}/{GENERATIONS_PREFIX}/g{generation}/{READY}/{world.rank_of(r)}" for r in world.joined}
        return wanted <= set(ready)

    def _run(self) -> None:
        from elastictrain.runtime.exitcodes import EXIT_NO_IN_PLACE

        since: Optional[float] = None
        try:
            while not self._stop.wait(_WATCH_S):
                mine = self._in_place.generation
                if mine is None or self._pausing():
                    since = None
                    continue
                try:
                    newest = self._newest()
                    newer = newest > mine
                    grow = self._grow(newest) if newer else None
                except Exception as e:  # noqa: BLE001 - etcd unreachable: nothing to judge by
                    log.debug("in-place watch: %s", e)
                    continue
                if grow is False:  # its new workers are still starting: train on
                    since = None
                    continue
                if grow is True and self._in_place.grow_ready is None:
                    log.info("a node's workers are ready to join (generation %d): re-forming at the next step "
                             "boundary", newest)
                    self._in_place.grow_ready_at = time.monotonic()
                    self._in_place.grow_ready = newest
                if grow is True and time.monotonic() - self._in_place.grow_ready_at < GROW_SAVE_WAIT_S:
                    since = None  # the loop may wait for a durable save in flight before it re-forms
                    continue
                if not newer:
                    since = None
                elif since is None:
                    since = time.monotonic()
                elif time.monotonic() - since >= self._grace() and not self._pausing():
                    log.error("a peer was replaced in place (generation %d), but this worker has been stuck in a "
                              "collective for %.0f s since; exiting so that every worker is restarted",
                              self._newest(), time.monotonic() - since)
                    self._exit(EXIT_NO_IN_PLACE)
                    return
        finally:
            if self._client is not None:
                self._client.close()


_group_sockets: set[tuple[int, Any, Any]] = set()
"""The connected TCP sockets (fd, local, remote address) the current gloo group opened (`tracked_sockets`)."""


def _tcp_sockets() -> set[tuple[int, Any, Any, str]]:
    import psutil

    return {(c.fd, c.laddr, c.raddr, c.status) for c in psutil.Process().net_connections(kind="tcp") if c.fd >= 0}


@contextlib.contextmanager
def tracked_sockets(avoid_ports: set[int]) -> Iterator[None]:
    """Remember the connections a gloo group opens while it forms (its pairs to every peer), so that a pause can shut
    them down (`shut_group_sockets`). Not its listener (gloo aborts the process when its accept fails), nor anything
    to `avoid_ports` (etcd, the first group's TCPStore), which other threads may open meanwhile."""
    try:
        before = {s[:3] for s in _tcp_sockets()}
    except Exception as e:  # noqa: BLE001 - no /proc: the pause still works, peers see it later
        log.debug("cannot list this process's sockets: %s", e)
        yield
        return
    yield
    _group_sockets.clear()
    for fd, laddr, raddr, status in _tcp_sockets():
        if (fd, laddr, raddr) in before or status == "LISTEN" or not raddr:
            continue
        if laddr.port in avoid_ports or raddr.port in avoid_ports:
            continue
        _group_sockets.add((fd, laddr, raddr))


def shut_group_sockets() -> int:
    """Shut down the current gloo group's connections (`tracked_sockets`), whatever still references the group.

    A survivor whose collective failed pauses, but its group lives on while FSDP references it, and so do its
    connections: a peer blocked on *this* rank (not on the dead one) would wait for its collective timeout, and
    miss the pause (seen with 3 nodes: the third survivor's agent called it hung). gloo's `abort`/`shutdown` do not
    close them then; shutting the sockets down does, and the peer's collective fails at once ("Connection closed
    by peer"), so it pauses too. Only sockets still open under the same fd and addresses are touched. Returns how
    many were shut down."""
    import socket

    if not _group_sockets:
        return 0
    try:
        now = {s[:3] for s in _tcp_sockets()}
    except Exception as e:  # noqa: BLE001
        log.debug("cannot list this process's sockets: %s", e)
        return 0
    shut = 0
    for fd, laddr, raddr in sorted(_group_sockets & now):
        try:
            s = socket.socket(fileno=os.dup(fd))  # a duplicate: closing it leaves gloo's fd alone
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)  # shuts the connection itself, for every fd that refers to it
            shut += 1
        except OSError as e:
            log.debug("shutdown of %s -> %s: %s", laddr, raddr, e)
        finally:
            s.close()
    _group_sockets.clear()
    if shut:
        log.info("shut down %d connections of the old process group: peers blocked on this rank stop waiting", shut)
    return shut


def abort_groups() -> None:
    """Abort and destroy every process group of this process: pending collectives fail at once, and peers still
    blocked on this rank see their connections close (which is how the failure reaches every survivor)."""
    shut_group_sockets()
    for pg in list(c10d._world.pg_map):
        try:
            pg.abort()
        except Exception as e:  # noqa: BLE001 - a backend without abort, or already broken
            log.debug("abort of process group %s: %s", c10d._world.pg_names.get(pg), e)
    if dist.is_initialized():
        dist.destroy_process_group()


PLACEHOLDER_BACKEND = "elastictrain_placeholder"
"""The backend of a joining worker's group until it joins the real one (`init_placeholder`)."""


def _placeholder_group(common_opts: Any, backend_opts: Any) -> dist.ProcessGroup:
    from torch._C._distributed_c10d import FakeProcessGroup

    options = FakeProcessGroup.Options()
    options.error_on_collective = True
    return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, options)


def init_placeholder(rank: int, world_size: int) -> None:
    """A default group of `world_size` that connects to nobody, for a worker that joins a running group (a grow's
    new rank, a replacement): it builds its mesh, model, optimizer and their memory on it before the others stop
    for it, then trades it for the real group (`Session.join`). Any collective on it raises ("FakeProcessGroup
    collective operation error"): a script runs none between `Worker` start and its step loop."""
    if not hasattr(dist.Backend, PLACEHOLDER_BACKEND.upper()):
        dist.Backend.register_backend(PLACEHOLDER_BACKEND, _placeholder_group, extended_api=True,
                                      devices=["cpu", "cuda"])
    dist.init_process_group(backend=PLACEHOLDER_BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)


def init_world(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta,
               device: torch.device, avoid_ports: Optional[set[int]] = None) -> None:
    """The default process group of a generation; its name is the first group's ("0") again, so the device mesh,
    which finds its groups by name, uses it without being rebuilt."""
    if device.type == "cuda":  # NCCL's abort ends pending collectives; its sockets are not ours to shut
        dist.init_process_group(backend="cpu:gloo,cuda:nccl", store=store, rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device)
        return
    with tracked_sockets(avoid_ports or set()):
        dist.init_process_group(backend="gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def rebind_fsdp(root: torch.nn.Module, reset: bool = True) -> int:
    """Point FSDP2's cached process groups (under `root`, the module `fully_shard` was applied to last) at the new
    groups of their meshes, and (`reset`) drop the failed step's state: unsharded parameters, pending collectives,
    gradients (FSDP's own `reset_iter_state`; a model that never ran a step has none, and FSDP cannot reset it).
    Returns how many FSDP parameter groups were rebound."""
    groups = []
    for module in root.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is not None:
            state = get_state()
            if hasattr(state, "_fsdp_param_groups"):
                groups += state._fsdp_param_groups
            elif getattr(state, "_fsdp_param_group", None) is not None:  # torch < 2.12: one group per module
                groups.append(state._fsdp_param_group)
    for group in groups:
        for info in {id(i): i for i in (group.mesh_info, group.post_forward_mesh_info) if i is not None}.values():
            info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
            if getattr(info, "replicate_process_group", None) is not None:
                info.replicate_process_group = info.mesh.get_group(info.replicate_mesh_dim)
    if not reset:
        return len(groups)
    reset_state = getattr(root, "reset_iter_state", None)
    if reset_state is not None:
        try:
            reset_state()
        except Exception as e:  # noqa: BLE001 - waiting on a collective of the aborted group failed: drop it
            log.debug("FSDP reset after a failed step: %s; dropping its pending collectives", e)
            for group in groups:
                group._all_gather_result = None
            reset_state()
    for group in groups:
        for fsdp_param in group.fsdp_params:
            # A backward cut short leaves gradients on the unsharded parameters (FSDP reuses those objects, and its
            # reset does not clear them): the next backward would add to them. Seen: a replay diverging at once.
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
            fsdp_param.unsharded_accumulated_grad = None
    for p in root.parameters():
        p.grad = None
    return len(groups)
