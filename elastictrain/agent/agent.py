"""Our elastic agent: torch's LocalElasticAgent plus worker heartbeats, hang detection and agent events.

A subclass rather than a wrapper: torch's run loop (rendezvous, restart budget, membership changes, exit
barrier, signal handling) is what we want; we only change how a group is judged (``_monitor_workers``),
how a hung group is stopped (``_stop_workers``) and what is reported. The rendezvous stays whatever
``spec.rdzv_handler`` is (c10d, etcd3, ...).
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
from dataclasses import asdict, replace
from typing import Any, Callable, Protocol, Sequence

import psutil
from torch.distributed import DistStoreError
from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elastictrain.agent import stopsignal
from elastictrain.agent.budget import (
    CrashLoopError,
    FatalWorkerError,
    NoProgressError,
    RestartBudget,
    RestartBudgetExhausted,
    fatal_message,
)
from elastictrain.agent.health import Hang, HealthConfig, HealthMonitor, WorkerHealth
from elastictrain.agent.scratch import make_scratch_dir
from elastictrain.agent.shrink import adopt_grows, adopt_shrinks, finished, joined, record_finished, renumber
from elastictrain.agent.spares import WarmPool
from elastictrain.agent.warm import WarmContext, torch_starts_workers_with
from elastictrain.errors import AgentError
from elastictrain.rendezvous.shrink import ENV_ROUND, World
from elastictrain.runtime.exitcodes import EXIT_FATAL, EXIT_NO_IN_PLACE, EXIT_REFORM
from elastictrain.runtime.heartbeat import (
    ENV_AGENT_PID,
    ENV_HEARTBEAT_ADDR,
    MAX_DATAGRAM_BYTES,
    Beat,
    WorkerEvent,
    decode,
    section_phase,
)
from elastictrain.runtime.inplace import ENV_GENERATION, entered, formed, next_generation

log = logging.getLogger(__name__)

_GROW_CHECK_S = 0.5
"""How often an agent whose workers wait to grow a shrunk round back reads whether the job finished meanwhile."""

SPARE_WARMUP_WAIT_S = 120.0
"""The longest an agent delays its first rendezvous for its spare workers' imports."""

MONITOR_STALL_S = 2.0
"""A monitor loop held up longer than this restarts the hang timers instead of judging silence it caused."""

SILENT_STARTUP_S = 10.0
"""Workers that send no heartbeats count as past their start-up (imports, process group) after this long."""

REFILL_WAIT_MAX_S = 60.0
"""Spares are refilled once the new group made its first step, or this long after it started, whichever is first:
a group that never reports one (stuck loading, a script without our API) must not cost the node its spares."""

REFILL_MIN_LEFT_S = 30.0
"""No spares are refilled when the job ends sooner than this at the group's pace (`total_steps` known) or is ending:
each costs an import's CPU (about 6 s on a core) that a restart this close to the end would hardly win back."""

MAX_MONITOR_INTERVAL_S = 0.5
"""A worker exit must be seen within this; a longer --monitor-interval is allowed but warned about."""

_MAX_DRAIN = 10_000
_ROUND_SETUP_ATTEMPTS = 3
"""Rendezvous rounds tried when a round's set-up (the ranks its first node publishes) never arrives."""
# torch >= 2.12 takes the workers' grace period before SIGKILL as an argument; older ones always wait 30 s.
_TORCH_HAS_SHUTDOWN_TIMEOUT = "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters
_UNIX_PATH_MAX = 107

EVENT_KINDS = ("join", "restart", "failure", "hang", "reform", "succeeded", "leave", "fatal", "budget_exhausted",
               "crash_loop", "no_progress")
"""The agent's own kinds passed to ``AgentEventListener.on_event``; workers' events (``checkpoint_*``, see
``runtime.heartbeat.WORKER_EVENT_PREFIXES``) are passed on too."""


class AgentEventListener(Protocol):
    """Receives agent events (see ``EVENT_KINDS``); the etcd status/event publisher implements this.

    Called on the agent's monitor thread: return quickly. Exceptions are logged and swallowed, since
    a failing publisher (etcd down) must never stop training.
    """

    def on_event(self, kind: str, fields: dict[str, Any]) -> None: ...


class JsonlEventLog:
    """Appends events as JSON lines to a local file (`--event-log`); etcd gets them from `EtcdStatusPublisher`."""

    def __init__(self, path: str):
        self._path = path
        self._lock = threading.Lock()

    def on_event(self, kind: str, fields: dict[str, Any]) -> None:
        line = json.dumps({"kind": kind, **fields}, default=str)
        with self._lock, open(self._path, "a") as f:
            f.write(line + "\n")


class _HeartbeatChannel:
    """The agent end of the heartbeat socket: bound in a private 0700 directory, drained without blocking."""

    def __init__(self) -> None:
        self._dir = make_scratch_dir("hb")
        self.addr = os.path.join(self._dir, "hb.sock")
        if len(self.addr) > _UNIX_PATH_MAX:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise AgentError(f"heartbeat socket path {self.addr!r} is longer than {_UNIX_PATH_MAX} bytes; "
                             "set TMPDIR to a shorter directory")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.addr)
        self._sock.setblocking(False)

    def drain(self) -> tuple[list[Beat], list[WorkerEvent]]:
        """Everything the workers sent since the last call: their beats, and their events for the event log."""
        beats: list[Beat] = []
        events: list[WorkerEvent] = []
        for _ in range(_MAX_DRAIN):
            try:
                data = self._sock.recv(MAX_DATAGRAM_BYTES)
            except BlockingIOError:
                break
            try:
                msg = decode(data)
            except ValueError as e:
                log.debug("ignoring datagram on heartbeat socket: %s", e)
                continue
            if isinstance(msg, Beat):
                beats.append(msg)
            else:
                events.append(msg)
        return beats, events

    def close(self) -> None:
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class ElasticAgent(LocalElasticAgent):
    """LocalElasticAgent whose workers heartbeat to it; a hang fails the group like a crash does."""

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        health: HealthConfig | None = None,
        listeners: Sequence[AgentEventListener] = (),
        budget: RestartBudget | None = None,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
        clock: Callable[[], float] = time.monotonic,
        warm_spares: bool = True,
        warm_pool: WarmPool | None = None,
    ):
        kwargs: dict[str, Any] = {"log_line_prefix_template": log_line_prefix_template}
        if _TORCH_HAS_SHUTDOWN_TIMEOUT:
            kwargs["shutdown_timeout"] = shutdown_timeout
        super().__init__(spec, logs_specs, start_method=start_method, exit_barrier_timeout=exit_barrier_timeout,
                         **kwargs)
        self._health = HealthMonitor(health or HealthConfig())
        self._listeners: list[AgentEventListener] = list(listeners)
        self._clock = clock
        self._channel: _HeartbeatChannel | None = None
        self._pending_hang: list[Hang] = []
        self._budget = budget
        self._reform = False
        self._last_cause = ""
        self._fatal: str | None = None
        self._hostname = socket.gethostname()
        self._warm: WarmPool | None = None
        self._refill = False
        self._refill_by = 0.0
        self._spares_announced = True
        self.total_steps = 0
        self._hang_deferred: dict[int, tuple[Any, Any]] | None = None
        """In place: each local worker's (step, phase) when a hang of waiting workers was deferred (`_defer_hang`)."""
        self._round_ranks: dict[int, int] = {}
        """Each local worker's global rank when its round formed: its name in the round's in-place shrinks."""
        self._rank_env: dict[int, dict[str, str]] = {}
        """After the round shrank in place: the environment an in-place replacement of each local rank starts with."""
        self.in_place_store: Any = None
        """With `elastic.in_place`: the run's generation counter in etcd (runtime/inplace.py); a failed worker is then
        replaced alone while its peers wait in place. Set before `run`."""
        self._grow_pending: tuple[int, int] | None = None
        """(round, generation) while this node's workers, started to grow a shrunk round back, have not trained yet."""
        self._grow_checked = 0.0
        self._rendezvoused = False
        """A node takes a lost node's place in place (rendezvous/vacancy.py) only at its first rendezvous."""
        self.peer_step_times: dict[int, float] = {}
        """World size -> a calibrated step time other nodes of this run published (set before `run`): the hang
        rule's prior for this agent's first group of that size."""
        """The job's last step, when known (`elastictrain run` with the recipe sets train.steps); 0: unknown."""
        self._last_tick: float | None = None
        if isinstance(spec.entrypoint, str) and spec.numa_options is None:
            # Also without spares: the pool's process context stops a crashed group's survivors fast.
            size = spec.local_world_size if warm_spares else 0
            self._warm = warm_pool or WarmPool(spec.entrypoint, spec.args, size)
            self._warm.size = size
        elif warm_pool is not None:
            warm_pool.close()
        if spec.monitor_interval > MAX_MONITOR_INTERVAL_S:
            log.warning("monitor interval %.2fs is above %.1fs: worker exits will be noticed late",
                        spec.monitor_interval, MAX_MONITOR_INTERVAL_S)

    def add_listener(self, listener: AgentEventListener) -> None:
        self._listeners.append(listener)

    def worker_health(self) -> dict[int, WorkerHealth]:
        """A copy of the last heartbeat state per local rank (for status publishing)."""
        return {lr: replace(w, phase=self._health.phase_name(w.phase)) for lr, w in self._health.workers.items()}

    def step_time(self) -> float | None:
        """The calibrated step time (p95 by default), None until enough steps were seen."""
        return self._health.step_time()

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        self._ensure_channel()
        if self._warm is not None:
            self._warm.fill()
            if self._warm.size:
                self._join_when_warm()
        outcome = "unknown"
        try:
            stopsignal.install()  # a stop signal passes every best-effort handler on its way here (stopsignal.py)
            with stopsignal.as_torch_signal():  # also one that lands in torch's run outside `_invoke_run`
                result = super().run(role)
            outcome = result.state.value if result is not None else "rendezvous closed"
            return result
        except SignalException as e:
            outcome = f"signal {e.sigval.name}"
            raise
        except Exception as e:
            outcome = f"error: {type(e).__name__}: {e}"
            raise
        finally:
            stopsignal.uninstall()
            self._emit("leave", outcome=outcome)
            if self._channel is not None:
                self._channel.close()
                self._channel = None
            if self._warm is not None:
                self._warm.close()
            # The agent's run is its process's last work: the interpreter's final collection of the heap torch
            # and the clients built (seconds, measured 0.3-3.6 s here) would only delay the exit the job waits for.
            gc.freeze()

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        with stopsignal.as_torch_signal():  # torch's run stops the workers with the signal (a drain), then re-raises
            return super()._invoke_run(role)

    def _join_when_warm(self) -> None:
        """Join only once this node's spares have imported the worker code.

        A joining node makes every running node stop its workers; joining while our own workers still import
        would leave the whole group idle for that long (10-20 s on busy cores), instead of training on.
        """
        started = time.monotonic()
        deadline = started + SPARE_WARMUP_WAIT_S
        while self._warm.ready() < self._warm.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        log.info("%d spare worker(s) ready after %.1fs; joining the rendezvous", self._warm.ready(),
                 time.monotonic() - started)

    def _ensure_channel(self) -> _HeartbeatChannel:
        if self._channel is None:
            self._channel = _HeartbeatChannel()
        return self._channel

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        channel = self._ensure_channel()
        # The same two values for every local worker, and SubprocessHandler / spawn both pass the agent's
        # environment on: setting them here needs no copy of torch's per-worker env construction.
        os.environ[ENV_HEARTBEAT_ADDR] = channel.addr
        os.environ[ENV_AGENT_PID] = str(os.getpid())
        # The old group's beats are stale; its events (a save that finished as it stopped) are still news.
        self._emit_worker_events(channel.drain()[1])
        self._pending_hang = []
        self._last_tick = None
        # The lost node's place this node's handler took at this rendezvous: its workers join the survivors' group.
        took_over = getattr(worker_group.spec.rdzv_handler, "took_over", None) if self.in_place_store else None
        if self.in_place_store is not None:  # the round names the workers' places in a later smaller world
            self._tell_round(worker_group)
        grow = getattr(worker_group.spec.rdzv_handler, "grow_world", None) if took_over is not None else None
        # A grow (a shrunk round's open place) recorded its generation with its world; a held place starts one.
        generation = grow.generation if grow is not None else \
            self._join_generation(worker_group) if took_over is not None else None
        if generation is not None:  # every local worker replaces one of the lost node's
            os.environ[ENV_GENERATION] = str(generation)
        try:
            pids = self._spawn(worker_group)
        finally:
            os.environ.pop(ENV_GENERATION, None)
            stopsignal.install()  # torch installed its handler again as it started them
        if self.in_place_store is not None and isinstance(self._pcontext, WarmContext):
            self._pcontext.keep_survivors = True
        self._hang_deferred = None
        self._round_ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
        self._rank_env = {}
        if grow is not None:  # started with their round ranks; each finds its rank in the bigger world itself
            self._rank_env = renumber(worker_group, self._round_ranks, grow)
        world = worker_group.workers[0].world_size if worker_group.workers else 0
        self._health.reset(pids, self._clock(), world_size=world)
        if world in self.peer_step_times:
            self._health.adopt_calibration(world, self.peer_step_times[world])
        if self._warm is not None:
            log.info("workers started (%d from pre-warmed spares so far, %d cold)", self._warm.served,
                     self._warm.cold)
        self._grow_pending = (took_over.round, grow.generation) if grow is not None else None
        if grow is not None:
            ranks = sorted(w.global_rank for w in worker_group.workers)
            log.warning("took lost node %s's place in the shrunk round in place: ranks %s of %d (generation %d)",
                        took_over.lost, ", ".join(map(str, ranks)), grow.size, grow.generation)
            self._emit("grow", reason="node joined", in_place=True, joined_nodes=[self._node_id()],
                       places_of=[took_over.lost], generation=grow.generation, world_size=grow.size,
                       from_world_size=grow.size - len(grow.joined), pids=dict(pids),
                       global_ranks={w.local_rank: w.global_rank for w in worker_group.workers}, recorded_here=True)
        elif generation is not None:
            ranks = sorted(w.global_rank for w in worker_group.workers)
            log.warning("took over lost node %s's ranks %s in place (generation %d)", took_over.lost,
                        ", ".join(map(str, ranks)), generation)
            self._emit("restart", reason="node re-join", in_place=True, generation=generation, replaced_ranks=ranks,
                       lost_node=took_over.lost, held_since=round(took_over.offered_at, 3), pids=dict(pids),
                       remaining_restarts=self._remaining_restarts,
                       backoff_s=0.0, step_reached=None)
        return pids

    def _tell_round(self, worker_group: WorkerGroup) -> None:
        handler = worker_group.spec.rdzv_handler
        if hasattr(handler, "local_world_size"):
            handler.local_world_size = worker_group.spec.local_world_size
            handler.workers_paused = self._workers_paused
        try:
            os.environ[ENV_ROUND] = str(rdzv_round(worker_group))
        except AgentError:  # not our rendezvous: no shrinks either
            os.environ.pop(ENV_ROUND, None)

    def workers_restoring(self) -> bool:
        """A local worker is paused in place or loading its state (a restore, a re-form in place): the node's
        snapshot replica waits meanwhile (agent/replication.py), the restore has the cores and the link."""
        return any(w.phase in ("paused", "load") for w in list(self._health.workers.values()))

    def _workers_paused(self) -> bool:
        """Every local worker pauses in place (its collectives failed): the evidence that a lost peer died."""
        workers = list(self._health.workers.values())
        return bool(workers) and all(w.phase == "paused" for w in workers)

    def _join_generation(self, worker_group: WorkerGroup) -> int | None:
        """The process-group generation this node's workers start in after taking a lost node's place: a new one,
        which the survivors' workers (paused in place) join too. None when it cannot be started (etcd down): the
        workers then start as in a new round, fail to meet their peers, and the agents fall back to a restart."""
        try:
            return int(next_generation(self.in_place_store))
        except Exception as e:  # noqa: BLE001 - etcd errors come in several types
            log.warning("could not start a new process-group generation for the lost node's place (%s)", e)
            return None

    def _spawn(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if self._warm is None:
            pids = super()._start_workers(worker_group)
        else:
            # torch builds each worker's environment and log files, then starts the processes; the pool serves
            # that start. torch offers no seam for it (see torch_starts_workers_with), and copying its
            # environment construction would drift from torch's.
            with torch_starts_workers_with(self._warm.start_processes):
                pids = super()._start_workers(worker_group)
            self._refill, self._refill_by = True, self._clock() + REFILL_WAIT_MAX_S
        return pids

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        started = time.monotonic()
        handler = worker_group.spec.rdzv_handler
        claim = getattr(handler, "claim_vacancy", None)
        if self.in_place_store is not None and not self._rendezvoused and claim is not None:
            # A node started while its peers pause in place for a lost node: take that node's place, no new round.
            claim(worker_group.spec.local_world_size)
        self._rendezvoused = True
        for attempt in range(_ROUND_SETUP_ATTEMPTS):
            try:
                super()._rendezvous(worker_group)
                break
            except DistStoreError as e:
                # The round formed, but its set-up never came through its store: torch's group-rank-0 agent
                # publishes every node's ranks there, and a node killed right after the round formed never does.
                # Seen in the netns chaos run: the agent waited 60 s, crashed, and its exit ended the whole job.
                # A new round (torch's next_rendezvous leaves the old one first) forms without the dead node.
                if attempt == _ROUND_SETUP_ATTEMPTS - 1:
                    raise
                log.warning("rendezvous round set up incompletely (%s): its first node probably died right after "
                            "it formed; joining a new round", e)
        log.info("rendezvous complete in %.2fs: node %d of %d, world size %d", time.monotonic() - started,
                 worker_group.group_rank, worker_group.group_world_size,
                 worker_group.workers[0].world_size if worker_group.workers else 0)

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        super()._initialize_workers(worker_group)
        workers = worker_group.workers
        self._emit("join", group_world_size=worker_group.group_world_size,
                   world_size=workers[0].world_size if workers else 0,
                   local_world_size=worker_group.spec.local_world_size,
                   pids={w.local_rank: w.id for w in workers},
                   global_ranks={w.local_rank: w.global_rank for w in workers})

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        if self._fatal is not None:
            raise FatalWorkerError(fatal_message(self._node_id(), self._fatal))
        failed = worker_group.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}
        if failed and self._reform:
            # Workers stopped cleanly because a peer node drained: re-form, free of charge.
            self._remaining_restarts += 1
            failed = False
        self._reform = False
        backoff = self._charge_restart(worker_group) if failed and self._budget is not None else 0.0
        if failed and backoff == 0 and self._replace_in_place(worker_group):
            return
        stuck = not failed and self._stuck_on_lost_members()
        self._emit("restart", reason="failure" if failed else "membership change", step_reached=self._step_reached(),
                   remaining_restarts=self._remaining_restarts, backoff_s=round(backoff, 2),
                   **({"stuck_on_lost_node": True} if stuck else {}))
        if stuck:
            # A graceful stop ends at a step boundary that every rank agrees on, which a dead peer never reaches: a
            # worker blocked in a collective with it runs no signal handler, and torch would wait out its whole
            # shutdown timeout (30 s) before the SIGKILL. Their state is in the snapshots and checkpoints.
            log.warning("this node's workers made no progress since a lost node of the round went away: stopping "
                        "them at once (SIGKILL) instead of waiting for a graceful stop")
            self._signal_workers(signal.SIGKILL)
        # torch's _restart_workers, with the backoff between stopping the old group and joining the next round.
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.STOPPED
        if backoff > 0:
            log.warning("restart backoff: the last restarts made no progress; waiting %.1fs before re-joining",
                        backoff)
            time.sleep(backoff)
        self._initialize_workers(worker_group)

    def _stuck_on_lost_members(self) -> bool:
        """A new round because members of the round lost their lease (etcd_handler `members_lost_at`), and no local
        worker made progress since, nor for 1.5 of its step times: each is blocked on them (seen: a survivor whose
        collective with a SIGKILLed node never failed; it ignored the graceful stop for torch's 30 s). A node alive
        behind a lapsed lease leaves its peers training: they progress within a step. Consumes the handler's mark."""
        handler = self._worker_group.spec.rdzv_handler
        lost_at = getattr(handler, "members_lost_at", None)
        if lost_at is None:
            return False
        handler.members_lost_at = None
        workers = list(self._health.workers.values())
        if not workers or not self._health.beats_seen:
            return False
        now, step = self._clock(), self._health.step_time()
        last = [w.last_progress if w.last_progress is not None else w.started for w in workers]
        return all(t < lost_at and (step is None or now - t > 1.5 * step) for t in last)

    def _replace_in_place(self, worker_group: WorkerGroup) -> bool:
        """`elastic.in_place`: start new processes for the failed local ranks only, in a new process-group generation
        that the survivors (here and on the other nodes, paused in place) join. False: not possible here (a hang, an
        error that asks for a full restart, nothing survives), so every worker is restarted instead."""
        ctx = self._pcontext
        if self.in_place_store is None or not isinstance(ctx, WarmContext):
            return False
        if self._pending_hang and not self._kill_hung_culprits(ctx):
            return False
        failures = dict(ctx._failures)
        world = worker_group.workers[0].world_size if worker_group.workers else 0
        if not failures or len(failures) >= world or any(
                f.exitcode in (EXIT_FATAL, EXIT_REFORM, EXIT_NO_IN_PLACE) for f in failures.values()):
            return False
        try:
            grow = self._pending_grow(worker_group)
            began = grow is not None and entered(self.in_place_store, grow.generation)
        except Exception as e:  # noqa: BLE001 - etcd unreachable: the replacement would not start either
            log.warning("could not read whether a grow is pending (%s); restarting every worker", e)
            return False
        if grow is not None:
            # The grow's new workers wait in its generation's group, which a newer generation would never form (a
            # 1:2 job whose only survivor failed stalled there until the next fault). So the replacement joins that
            # generation instead: the survivors (paused: their collectives with it failed) go to it as the newest,
            # the new workers were waiting for it, and all restore from the snapshots, not from anyone's live state.
            # Not once anyone entered that group: it may exist without the failed rank (`ENTERED`).
            if began:
                log.warning("a worker failed while the round's grow (generation %d) re-forms: its group may exist "
                            "without it; restarting every worker", grow.generation)
                return False
            self._rank_env = renumber(worker_group, self._round_ranks, grow)
            if any(lr not in self._rank_env for lr in failures):
                log.warning("a worker failed while the round's grow (generation %d) has not re-formed, and its place "
                            "in the grown world is not known; restarting every worker", grow.generation)
                return False
        try:
            generation = grow.generation if grow is not None else next_generation(self.in_place_store)
            pids = {lr: ctx.replace(lr, {ENV_GENERATION: str(generation), **self._rank_env.get(lr, {})})
                    for lr in sorted(failures)}
        except Exception as e:  # noqa: BLE001 - etcd down, no process could start: the full restart may still work
            log.warning("could not replace the failed worker(s) in place (%s); restarting every worker", e)
            return False
        self._hang_deferred = None
        now = self._clock()
        if self._warm is not None:  # the replacement took a spare: the next fault needs one too
            self._refill, self._refill_by = True, now + REFILL_WAIT_MAX_S
        for lr, pid in pids.items():
            worker_group.workers[lr].id = pid
            self._health.workers[lr] = WorkerHealth(local_rank=lr, pid=pid, started=now)
        ranks = sorted(worker_group.workers[lr].global_rank for lr in pids)
        if grow is None:
            log.warning("replacing rank(s) %s in place (generation %d); the other workers wait with their state",
                        ", ".join(map(str, ranks)), generation)
        else:
            log.warning("replacing rank(s) %s in place into the round's pending grow (generation %d, a world of %d): "
                        "the new node's workers and the survivors form it with the replacement",
                        ", ".join(map(str, ranks)), generation, grow.size)
        self._emit("restart", reason="failure", in_place=True, step_reached=self._step_reached(),
                   generation=generation, replaced_ranks=ranks, **({"into_grow": True} if grow is not None else {}),
                   pids={lr: pid for lr, pid in pids.items()}, remaining_restarts=self._remaining_restarts,
                   backoff_s=0.0)
        worker_group.state = WorkerState.HEALTHY
        return True

    def _pending_grow(self, worker_group: WorkerGroup) -> World | None:
        """The round's grow when it is recorded but has not formed yet (its new workers wait in its generation's
        group, not yet joined by the survivors); else None. Raises when etcd cannot tell."""
        world_of = getattr(worker_group.spec.rdzv_handler, "world", None)
        if world_of is None:  # not our etcd rendezvous: no in-place shrink or grow
            return None
        world = world_of()
        if world is None or not world.joined or formed(self.in_place_store, world.generation):
            return None
        return world

    def _adopt_world_changes(self, worker_group: WorkerGroup) -> None:
        """The round dropped a lost node, or took one's place back, in place (its handler says so): this node's
        workers' new ranks."""
        handler = worker_group.spec.rdzv_handler
        if getattr(handler, "grown", None):
            overrides = adopt_grows(worker_group, self._round_ranks, self._emit)
            if overrides:
                self._rank_env = overrides
        if not getattr(handler, "shrunk", None):
            return  # the usual tick: nothing to read from etcd
        overrides = adopt_shrinks(worker_group, self._round_ranks, self._emit)
        if overrides:
            self._rank_env = overrides

    def _leave_in_place(self) -> None:
        """A drain (SIGTERM/SIGINT while the workers train, or `elastictrain drain`): record this node gone from the
        running round before its workers stop, so that the other nodes' workers, stopped at the same step boundary
        with the state saved, go on in place as a smaller world (rendezvous/shrink.py) instead of re-forming."""
        leave = getattr(self._worker_group.spec.rdzv_handler, "leave_in_place", None)
        world = leave() if leave is not None else None
        if world is not None:
            log.warning("leaving the job: the other nodes go on without this one in place, a world of %d "
                        "(generation %d)", world.size, world.generation)
            self._emit("shrink", reason="node drained", in_place=True, lost_nodes=list(world.gone),
                       generation=world.generation, world_size=world.size, recorded_here=True)

    def _step_reached(self) -> int | None:
        """The step this node's workers reached (their last beats), on its failure and restart events: the time
        ledger's recomputed steps take the highest over the nodes (the restart record has only the first charging
        node's, and a survivor stopped for a restart never reports a failure)."""
        reached = [w.step for w in self._health.workers.values() if w.step is not None]
        return max(reached) if reached else None

    def _kill_hung_culprits(self, ctx: WarmContext) -> bool:
        """In place, a hang: SIGKILL the hung workers that are stopped or in uninterruptible sleep (the culprits; the
        others only wait on them in a collective and pause in place once it fails) and record them as failed.
        False when none is a culprit: a worker that spins without progress cannot be told from a slow one, so every
        worker is restarted."""
        culprits = [h for h in self._pending_hang if _process_state(h.pid) in _CULPRIT_STATES]
        if not culprits:
            return False
        for h in culprits:
            try:
                os.kill(h.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for h in culprits:
            handler = ctx.subprocess_handlers[h.local_rank]
            try:
                handler.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - not reaped in time (D state): the full restart deals with it
                return False
            ctx._running_local_ranks.discard(h.local_rank)
            ctx._failures[h.local_rank] = ProcessFailure(local_rank=h.local_rank, pid=h.pid,
                                                        exitcode=-int(signal.SIGKILL),
                                                        error_file=ctx.error_files[h.local_rank])
        self._pending_hang = []
        return True

    def _defer_hang(self, hangs: list[Hang], now: float) -> bool:
        """Workers that are silent only because they wait in a collective on a peer of another node get one more
        hang timeout. When that peer is the hung one, its own agent sees it at the same time, and it alone can tell
        which worker it is (stopped or in uninterruptible sleep): it names it in its hang event and, in place, kills
        and replaces it alone (these workers' collective fails and they pause in place). Without this, whichever
        agent looked first restarted the group, the culprit often unnamed. Out of place this applies only when every
        hung local worker sleeps (a spinning one may be the culprit) and the group spans nodes; a hang where every
        worker of every node sleeps (a collective deadlock) is then called one timeout later. Deferred once per
        stall: again only after some worker made progress."""
        states = [_process_state(h.pid) for h in hangs]
        if any(s in _CULPRIT_STATES for s in states):
            return False
        if self.in_place_store is None:
            spans_nodes = getattr(self._worker_group, "group_world_size", None) not in (None, 1)
            if not spans_nodes or any(s != psutil.STATUS_SLEEPING for s in states):
                return False
        progress = {lr: (w.step, w.phase) for lr, w in self._health.workers.items()}
        if self._hang_deferred == progress:
            return False
        self._hang_deferred = progress
        self._health.rebase(now)
        log.warning("worker(s) %s silent but waiting (%s), not hung themselves: giving a peer's agent one more "
                    "timeout to find a hung peer", ", ".join(str(h.local_rank) for h in hangs), ", ".join(states))
        return True

    def _charge_restart(self, worker_group: WorkerGroup) -> float:
        """Charge this failure to the job-wide budget; returns the backoff to wait, raises when the job must end."""
        assert self._budget is not None
        workers = self._health.workers.values()
        steps = [w.step for w in workers if w.step is not None]
        resumed = [w.first_step for w in workers if w.first_step is not None]
        try:
            rec = self._budget.charge(rdzv_round(worker_group), self._node_id(), self._last_cause,
                                      max(steps) if steps else None, min(resumed) if resumed else None)
        except AgentError as e:
            self._emit(_END_EVENT.get(type(e), "budget_exhausted"), cause=str(e))
            raise
        log.info("restart charged to round %d (%d of %d used)", rec.round, self._budget.used(tolerant=True),
                 self._budget.max_restarts)
        return self._budget.backoff_s()

    def _node_id(self) -> str:
        return getattr(self._worker_group.spec.rdzv_handler, "this_node", None) or f"{self._hostname}_{os.getpid()}"

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        if self._pending_hang:
            # A SIGSTOPped worker ignores SIGTERM until continued, and a worker blocked in a collective runs
            # no Python signal handler: both would cost torch's whole shutdown timeout. Kill the group.
            self._signal_workers(signal.SIGKILL)
            self._pending_hang = []
        elif self._grow_pending is not None and not joined(self._health.workers.values()):
            # Workers started to grow a round back that have not joined it hold no state: nothing to save. They
            # wait for that grow's group, where SIGTERM does not reach them, and torch's stop waited its 30 s (seen
            # in goodput.py: the survivor failed before the grow re-formed, and every node's new round waited for
            # this one). Kill them at once.
            log.warning("stopping this node's workers, which had not joined the grow they were started for: at once "
                        "(SIGKILL), they hold no state")
            self._signal_workers(signal.SIGKILL)
        super()._stop_workers(worker_group)

    def _grow_finished(self, now: float) -> bool:
        """Whether the job finished while this node's workers still wait to grow the round back (they never trained):
        the survivors finished without them, and would wait for this node in the exit barrier while they wait for a
        group that never forms. Read from etcd at most every `_GROW_CHECK_S`."""
        assert self._grow_pending is not None
        if joined(self._health.workers.values()):
            self._grow_pending = None  # they joined the bigger world: they finish with it
            return False
        if now - self._grow_checked < _GROW_CHECK_S:
            return False
        self._grow_checked = now
        try:
            return finished(self.in_place_store, self._grow_pending[0])
        except Exception as e:  # noqa: BLE001 - etcd blinked: look again at the next check
            log.debug("could not read whether the job finished: %s", e)
            return False

    def _abandon_grow(self, worker_group: WorkerGroup) -> RunResult:
        """The job finished before this node's workers joined it: stop them; this node is done too."""
        assert self._grow_pending is not None
        round_number, generation = self._grow_pending
        self._grow_pending = None
        log.warning("the job finished in round %d before this node's workers joined it (the grow of generation %d "
                    "never re-formed): stopping them", round_number, generation)
        self._emit("grow_abandoned", cause="the job finished before the grow re-formed the group",
                   generation=generation)
        worker_group.state = WorkerState.SUCCEEDED  # not a drain: nothing to leave in place
        self._signal_workers(signal.SIGKILL)
        self._stop_workers(worker_group)
        self._emit("succeeded")
        return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in worker_group.workers})

    def _exit_barrier(self) -> None:
        handler = self._worker_group.spec.rdzv_handler
        round_number = getattr(handler, "round_number", None)
        if self.in_place_store is not None and round_number is not None:
            try:  # a node that came to grow the round back, its workers not yet in the group, stops waiting for it
                record_finished(self.in_place_store, round_number)
            except Exception as e:  # noqa: BLE001 - etcd errors come in several types; a grow then waits it out
                log.warning("could not record in etcd that the job finished: %s", e)
        # After a smaller world in place, the round's nodes that left it never reach the barrier: count them out
        # (seen: a survivor that finished right after a peer's drain waited out the barrier's 300 s for it).
        members_left = getattr(handler, "members_left", None)
        if self.in_place_store is not None and members_left is not None:
            try:
                left = members_left()
            except Exception as e:  # noqa: BLE001 - etcd errors come in several types: wait for every member
                log.debug("could not read the round's in-place departures: %s", e)
                left = None
            if left is not None and 0 < left < self._worker_group.group_world_size:
                self._worker_group.group_world_size = left
        super()._exit_barrier()

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        if self.in_place_store is not None and self._worker_group.state == WorkerState.HEALTHY:
            self._leave_in_place()
        # Continue stopped workers so that the graceful signal can reach them before the SIGKILL deadline.
        self._signal_workers(signal.SIGCONT)
        if _TORCH_HAS_SHUTDOWN_TIMEOUT:
            super()._shutdown(death_sig, timeout)
        else:  # torch < 2.12: the workers get `death_sig`, then SIGKILL after torch's own 30 s
            super()._shutdown(death_sig)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        stopsignal.install()  # after anything else that started a worker (an in-place replacement)
        result = super()._monitor_workers(worker_group)
        now = self._clock()
        if self.in_place_store is not None:
            self._adopt_world_changes(worker_group)
        if self._channel is not None:
            # Also when the group just failed: the beats a worker sent right before it died say which step it
            # reached (the restart record and crash-loop detection use it). Seen: a worker that crashed 0.15 s
            # after resuming was charged as failing at step 0, its two train beats left unread in the socket.
            beats, events = self._channel.drain()
            for beat in beats:
                self._health.record(beat, now)
            self._emit_worker_events(events)
        if result.state == WorkerState.HEALTHY and self._grow_pending is not None and self._grow_finished(now):
            return self._abandon_grow(worker_group)
        if result.state == WorkerState.HEALTHY:
            held_up = now - self._last_tick if self._last_tick is not None else 0.0
            self._last_tick = now
            if held_up > MONITOR_STALL_S:
                # Our own loop stood still (an etcd call during an outage, a stalled machine): beats were not read
                # and some were dropped, so the silence we would measure is partly ours. Seen: a false hang
                # right after an etcd restart.
                self._health.rebase(now)
                log.warning("agent monitor loop was held up %.1fs; hang timers restart now", held_up)
            hangs = self._health.check(now)
            if self._warm is not None:
                if self._refill:
                    self._maybe_refill(now)
                if not self._spares_announced and self._warm.ready() >= self._warm.size:
                    self._spares_announced = True
                    log.info("%d spare worker(s) ready", self._warm.size)
            if hangs:
                running = self._running_local_ranks()
                hangs = [h for h in hangs if h.local_rank in running]
            if hangs and self._defer_hang(hangs, now):
                hangs = []
            if hangs:
                return self._hang_result(worker_group, hangs)
        elif result.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
            failures = [_failure_fields(rank, f) for rank, f in sorted(result.failures.items())]
            for f in failures:  # the time ledger's detection latency of a crash: at most this since its last beat
                w = self._health.workers.get(f["local_rank"])
                if w is not None and w.last_beat is not None:
                    f["last_beat_age_s"] = round(max(0.0, now - w.last_beat), 3)
            if failures and all(f["exitcode"] == EXIT_REFORM for f in failures):
                self._reform = True
                self._emit("reform", cause="every rank stopped at a step boundary (a node drained, or a straggler is "
                           "replaced); state saved, re-forming the group")
                return result
            cause = "; ".join(f"rank {f['global_rank']}: {f['message']}" for f in failures) or result.state.value
            self._last_cause = cause
            log.error("[%s] worker group %s: %s", worker_group.spec.role, result.state.value, cause)
            self._emit("failure", state=result.state.value, cause=cause, failures=failures,
                       step_reached=self._step_reached())
            fatal = [f for f in failures if f["exitcode"] == EXIT_FATAL]
            if fatal:
                self._record_fatal("; ".join(f"rank {f['global_rank']}: {f['message']}" for f in fatal))
        elif result.state == WorkerState.SUCCEEDED:
            self._emit("succeeded")
        return result

    def _record_fatal(self, cause: str) -> None:
        """A worker error that restarting cannot fix: tell every node (etcd) before this one ends the job."""
        if self._budget is not None:
            try:
                cause = self._budget.record_fatal(self._node_id(), cause).cause
            except Exception as e:  # etcd down: this node still ends; the others learn it from the closed round
                log.warning("could not record the fatal error in etcd: %s", e)
        self._fatal = cause
        self._emit("fatal", cause=cause)

    def _maybe_refill(self, now: float) -> None:
        """Refill the spares once the new group made its first step (they competed with it for CPU: at 150M on 2
        cores the first step after a restart took 17.6 s instead of 11 s), unless the job is about to end."""
        assert self._warm is not None
        left = self._health.seconds_left(self.total_steps) if self.total_steps else None
        if self._health.finishing() or (left is not None and left < REFILL_MIN_LEFT_S):
            self._refill = False
            log.info("not refilling spare workers: the job ends %s", "now" if left is None else f"in ~{left:.0f}s")
            return
        stepped = self._health.started_up(now, SILENT_STARTUP_S)
        if not (stepped or now >= self._refill_by):
            return
        self._refill = False
        started = self._warm.fill(while_training=True)
        self._spares_announced = not started
        if started:
            log.info("refilling %d spare worker(s) %s", started, "after the group's first step" if stepped
                     else f"{REFILL_WAIT_MAX_S:g}s after the group started, without a step from it yet")

    def _hang_result(self, worker_group: WorkerGroup, hangs: list[Hang]) -> RunResult:
        states = {h.pid: _process_state(h.pid) for h in hangs}
        # A stopped (or D-state) process is the culprit whatever its step; the rest keep health's order.
        hangs = sorted(hangs, key=lambda h: states[h.pid] not in _CULPRIT_STATES)
        causes = [f"{h.describe()}, process state '{states[h.pid]}'" for h in hangs]
        cause = "; ".join(causes)
        log.error("[%s] worker group hung: %s; stopping it with SIGKILL", worker_group.spec.role, cause)
        self._last_cause = f"hang: {cause}"
        self._pending_hang = hangs
        # Each hung worker's global rank and process state: `status` reads every node's events to say which rank
        # the hang started at (agent/hang_attribution.py).
        self._emit("hang", cause=cause, workers=[
            {**asdict(h), "rank": worker_group.workers[h.local_rank].global_rank, "state": states[h.pid]}
            for h in hangs])
        failures: dict[int, ProcessFailure] = {}
        for h, text in zip(hangs, causes):
            worker = worker_group.workers[h.local_rank]
            # exitcode: what the restart path is about to do to it; the message says why.
            failure = ProcessFailure(local_rank=h.local_rank, pid=h.pid, exitcode=-int(signal.SIGKILL),
                                     error_file="")
            failure.message = f"hang: {text}"
            failures[worker.global_rank] = failure
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _running_local_ranks(self) -> set[int]:
        running = set()
        for lr, pid in self._worker_pids().items():
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.add(lr)
            except psutil.NoSuchProcess:
                continue
        return running

    def _worker_pids(self) -> dict[int, int]:
        return self._pcontext.pids() if self._pcontext is not None else {}

    def _signal_workers(self, sig: signal.Signals) -> None:
        for pid in self._worker_pids().values():
            try:
                # Binary workers lead their own session (torch starts them so): signal their children too.
                if os.getpgid(pid) == pid:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                continue

    def _emit_worker_events(self, events: list[WorkerEvent]) -> None:
        """Workers' events (checkpoints) into the event log like the agent's own, with the reporting rank."""
        for ev in events:
            if ev.kind == "section_declared":  # the hang rule's business, not the job's event log
                f = ev.fields
                if isinstance(f.get("number"), int) and isinstance(f.get("name"), str):
                    timeout = f.get("timeout_s")
                    self._health.declare_section(section_phase(f["number"]), f["name"],
                                                 float(timeout) if isinstance(timeout, (int, float)) else None)
                continue
            # The agent's own fields win: a worker's field of the same name (world_size sets the node's in
            # status) must not rewrite what the event says about this node.
            fields = {k: v for k, v in ev.fields.items() if k not in _AGENT_FIELDS}
            self._emit(ev.kind, **fields, rank=ev.rank)

    def _emit(self, kind: str, **fields: Any) -> None:
        wg = self._worker_group
        base: dict[str, Any] = {
            "time": time.time(),
            "node": self._hostname,
            "agent_pid": os.getpid(),
            "run_id": wg.spec.rdzv_handler.get_run_id(),
            "group_rank": wg.group_rank,
            "restart_count": wg.spec.max_restarts - self._remaining_restarts,
        }
        base.update(fields)
        for listener in self._listeners:
            try:
                listener.on_event(kind, base)
            except Exception:
                log.exception("agent event listener %r failed on %s event", listener, kind)


def rdzv_round(worker_group: WorkerGroup) -> int:
    """The rendezvous round the group was formed in (torch's dynamic rendezvous keeps it in its state)."""
    holder = getattr(worker_group.spec.rdzv_handler, "_state_holder", None)
    state = getattr(holder, "state", None)
    if state is None or not hasattr(state, "round"):
        raise AgentError("a job-wide restart budget needs a dynamic rendezvous (etcd3 or c10d backend)")
    return int(state.round)


_AGENT_FIELDS = frozenset({"time", "node", "agent_pid", "run_id", "group_rank", "restart_count", "world_size", "rank"})
"""Fields the agent sets on every event (or status reads from one); a worker event cannot override them."""

_NO_ERROR_FILE = "To enable traceback see:"
"""How torch's ProcessFailure message starts when a worker exited with a code and left no error file."""


def _failure_message(failure: ProcessFailure) -> str:
    message: Any = failure.message
    if isinstance(message, dict):  # torch's @record writes {"message": "Type: text", "extraInfo": {...}}
        message = str(message.get("message", message))
    # A bare exit code (os._exit, a crash in native code) otherwise reads as a link to torch's docs.
    if failure.exitcode > 0 and message.startswith(_NO_ERROR_FILE):
        return f"exited with code {failure.exitcode} (pid {failure.pid}, no Python traceback recorded)"
    return message


_END_EVENT: dict[type, str] = {FatalWorkerError: "fatal", CrashLoopError: "crash_loop",
                               NoProgressError: "no_progress", RestartBudgetExhausted: "budget_exhausted"}
"""The event that says why the restart policy ended the job."""


def _failure_fields(global_rank: int, failure: ProcessFailure) -> dict[str, Any]:
    return {"global_rank": global_rank, "local_rank": failure.local_rank, "pid": failure.pid,
            "exitcode": failure.exitcode,
            "signal": failure.signal_name() if failure.exitcode < 0 else None, "message": _failure_message(failure)}


_CULPRIT_STATES = {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_DISK_SLEEP}


def _process_state(pid: int) -> str:
    try:
        return str(psutil.Process(pid).status())
    except psutil.NoSuchProcess:
        return "gone"
