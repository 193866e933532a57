"""`Worker`: the public API's entry point inside a training process.

    with elastictrain.Worker(seed=0) as w:
        model = fully_shard(build_model(), mesh=w.mesh)
        ...
        for step in w.steps(1000, state, checkpoint="file:///ckpt", every_steps=50):
            ...

It joins the process group and a 1-D device mesh from torchrun's environment (one process without one), and when
our agent started the process: ties the process's life to the agent's, opens the heartbeat channel and the
operator-control doorbell. SIGTERM/SIGINT become a stop request that the step loop honours at the next step
boundary, on every rank alike, after a save. On leaving the block it closes the process group, and turns the
run's ending into the exit code the agent acts on: an `ElastictrainError` that restarting cannot fix exits
`EXIT_FATAL` (2) with its one-line cause recorded; a stop asked by a rank of another node (a drain) exits
`EXIT_REFORM` (75), so the agent re-forms the group instead of calling the job done.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import logging
import os
import signal
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from elastictrain.config import CheckpointConfig, checkpoint_config, validate_checkpoint
from elastictrain.config import TrainConfig as _TrainConfig
from elastictrain.errors import ConfigError, ElastictrainError
from elastictrain.logs import setup_logging
from elastictrain.runtime.control import WorkerControl
from elastictrain.runtime.determinism import configure_determinism, seed_everything
from elastictrain.runtime.exitcodes import EXIT_NO_IN_PLACE, EXIT_REFORM, exit_fatal
from elastictrain.runtime.heartbeat import ENV_AGENT_PID, MAX_SECTIONS, Heartbeat, section_phase
from elastictrain.runtime.inplace import InPlace, InPlaceFailed, WorldShrank, is_peer_failure, rebind_fsdp
from elastictrain.runtime.session import RankInfo, Session
from elastictrain.runtime.steps import StepHook, StepLoop
from elastictrain.runtime.train_state import TrainState, prepare_for_load

log = logging.getLogger(__name__)

_LAST_BARRIER_S = 60.0


def _stacks_on_sigusr2() -> None:
    """Under our agent, `kill -USR2 <worker pid>` writes every thread's Python stack to the worker's stderr (the
    agent's log): where a stuck worker waits, without a debugger. Left alone when the script handles SIGUSR2."""
    if os.environ.get(ENV_AGENT_PID) and signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL:
        faulthandler.register(signal.SIGUSR2, all_threads=True)


class StopFlag:
    """Set by SIGTERM/SIGINT; acted on at the next step boundary, agreed by all ranks."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        """Put back the handlers that were there before (the process may go on after the Worker)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True


class Worker:
    """One training process of an elastic job; a context manager (see the module doc)."""

    def __init__(self, *, seed: int = 0, device: str = "auto", deterministic: bool | str = True,
                 collective_timeout_s: float = 600.0, log_level: Optional[str] = "INFO"):
        self.seed = int(seed)
        self.log_level = log_level
        self._train_cfg = _TrainConfig(device=device, deterministic=deterministic,  # type: ignore[arg-type]
                                       collective_timeout_s=collective_timeout_s, seed=self.seed)
        self.session: Optional[Session] = None
        self.heartbeat = Heartbeat(None)
        self.control = WorkerControl(None)
        self.stop_flag = StopFlag()
        self.loop: Optional[StepLoop] = None
        self._sections: dict[str, int] = {}

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> "Worker":
        if self.log_level and not logging.getLogger().handlers and not logging.getLogger("elastictrain").handlers:
            # A script that set up no logging still sees progress and recovery (rank 0; warnings from every rank).
            setup_logging(self.log_level)
        # The doorbell handler first: the agent rings only workers that sent a heartbeat (runtime/control.py).
        self.control = WorkerControl.from_env()
        self.heartbeat = Heartbeat.from_env()
        _stacks_on_sigusr2()
        self.stop_flag.install()
        configure_determinism(self._train_cfg.deterministic)
        self.session = Session(self._train_cfg).start()
        # The same seed on every rank until the first step: models built now are initialised alike everywhere.
        seed_everything(self.seed)
        return self

    def close(self) -> None:
        # The interpreter's final garbage collection walks every object torch and the model made (seconds of CPU
        # at exit, and a restart or re-form waits for the exit): they live until the process ends anyway.
        gc.freeze()
        self.stop_flag.uninstall()
        self.control.close()
        if self.session is not None:
            self.session.close()
            self.session = None
        self.heartbeat.close()

    def __enter__(self) -> "Worker":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        if self.loop is not None:
            self.loop.close(wait=exc is None)
        if exc is None:
            self._last_barrier()
        in_place = self.in_place is not None
        self.close()
        if isinstance(exc, WorldShrank):
            log.warning("%s", exc)
            raise SystemExit(EXIT_REFORM) from None
        if in_place and exc is not None and (isinstance(exc, InPlaceFailed) or is_peer_failure(exc)):
            # Not replaced in place: tell the agent to restart every worker (it would replace this one alone).
            log.error("%s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            raise SystemExit(EXIT_NO_IN_PLACE) from None
        if isinstance(exc, ElastictrainError):
            log.error("%s", exc)
            if not exc.restartable:
                # Restarting cannot fix it: the agent ends the job on every node with this cause.
                raise SystemExit(exit_fatal(str(exc))) from None
        elif exc is None and self.loop is not None and self.loop.stopped_by_peer:
            raise SystemExit(EXIT_REFORM)

    def _last_barrier(self) -> None:
        """Leave together: a rank that destroys its process group while a peer still finishes the last collective
        with it (rank 0 hashing the full state for `digest()`, the others already done) fails that peer's
        collective ("Connection closed by peer"). Bounded, and never an error: everything is saved by now."""
        if self.session is None or self.world_size == 1:
            return
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=_LAST_BARRIER_S))
        except Exception as e:  # a peer that died or left: nothing to wait for
            log.debug("final barrier: %s", e)

    # --- what the user reads ---------------------------------------------------------------------------

    def _session(self) -> Session:
        if self.session is None:
            raise RuntimeError("the Worker is not started: use `with elastictrain.Worker(...) as w:`")
        return self.session

    @property
    def info(self) -> RankInfo:
        return self._session().info

    @property
    def rank(self) -> int:
        return self._session().rank

    @property
    def world_size(self) -> int:
        return self._session().world_size

    @property
    def local_rank(self) -> int:
        return self._session().info.local_rank

    @property
    def is_main(self) -> bool:
        return self._session().is_main

    @property
    def device(self) -> torch.device:
        return self._session().device

    @property
    def mesh(self) -> DeviceMesh:
        mesh = self._session().mesh
        assert mesh is not None
        return mesh

    @property
    def in_place(self) -> Optional[InPlace]:
        """Set when the agent runs the job with `elastic.in_place` (see `guard`)."""
        return self.session.in_place if self.session is not None else None

    def rebuild_group(self, generation: int) -> bool:
        """The in-place path: this process's groups replaced by generation `generation`'s, FSDP pointed at them.
        When the world shrank by then (rendezvous/shrink.py), this rank takes its place in the smaller world and the
        step loop's `rebuild` builds the model again on the new mesh; True then (the state must be loaded again)."""
        session, in_place = self._session(), self.in_place
        assert in_place is not None
        world = in_place.world_at(generation)
        rank = size = None
        if world is not None:
            rank = world.rank_of(in_place.round_rank)
            if rank is None:
                raise InPlaceFailed(f"this worker (round rank {in_place.round_rank}) is not in the smaller world of "
                                    f"generation {generation}; restarting every worker instead")
            size = world.size
            if (rank, size) != (self.rank, self.world_size) and (self.loop is None or not self.loop.can_rebuild):
                what = "grew" if world.joined and size > self.world_size else "shrank"
                raise WorldShrank(f"the world {what} in place to {size} ranks, but the script gave Worker.steps no "
                                  f"`rebuild` to build its model on the new mesh; re-forming in a new round instead")
        if world is not None and world.joined and world.generation == generation:
            in_place.mark_entered(generation)  # a grow's group: a failure from now on restarts every worker
        before = self.world_size
        if session.rebuild(generation, rank, size):
            assert self.loop is not None
            log.warning("the world changed size in place to %d ranks: now rank %d; building the model on the new "
                        "mesh", self.world_size, self.rank)
            self.loop.rebuild_state(shrank=self.world_size < before)
            return True
        model = self.loop.state.model if self.loop is not None else None
        if model is not None:
            rebind_fsdp(model)
        return False

    @property
    def metrics(self) -> dict[str, float]:
        """What `report` got in the last finished step, summed over ranks."""
        return dict(self.loop.metrics) if self.loop is not None else {}

    @property
    def resumed_from(self) -> Optional[str]:
        """Where the loop's state came from: a checkpoint URL, `snapshot:step-N`, or None (a fresh start)."""
        return self.loop.resumed_from if self.loop is not None else None

    @property
    def start_step(self) -> int:
        """The step the loop started at (0 on a fresh start)."""
        return self.loop.start_step if self.loop is not None else 0

    @property
    def stopped(self) -> bool:
        """The loop ended early: a stop (SIGTERM, a drain) was agreed, the state is saved."""
        return self.loop is not None and self.loop.stopped

    # --- training --------------------------------------------------------------------------------------

    def steps(self, total: int, state: TrainState, *, checkpoint: str | CheckpointConfig | None = None,
              fingerprint: Optional[dict[str, Any]] = None, metadata: Optional[dict[str, Any]] = None,
              audit_dir: Optional[str] = None, log_every: int = 0, on_step: Optional[StepHook] = None,
              init: Optional[Callable[[], None]] = None, rebuild: Optional[Callable[[], TrainState]] = None,
              **checkpoint_options: Any) -> StepLoop:
        """The training loop: `for step in w.steps(total, state, ...)` yields each step index still to run.

        `checkpoint`: a URL (file://, s3://, a path) or a full `CheckpointConfig`; `every_steps`, `every_seconds`,
        `keep_last`, `resume`, `storage_options`, ... (`CheckpointConfig`'s fields) may be passed as keywords.
        `fingerprint`: plain data a checkpoint must match to be resumed (e.g. your model config).
        `metadata`: stored in each checkpoint's manifest. `audit_dir`: record every step's samples per rank
        (the exactly-once audit). `log_every`: log reported values and step time every N steps (rank 0).
        `on_step(step, metrics)`: called on every rank after each step, with the reported values summed.
        `init()`: called on every rank when nothing was restored (a fresh start), before the first step: initialise
        weights there (a model built on the meta device, sharded, then `to_empty`), so that a restart does not
        pay for an initialisation that the load overwrites.
        `rebuild()`: with `elastic.in_place`, called on every rank when the world shrank in place (a node lost for
        good): build the model (on `w.mesh`, the new mesh), optimizer and scheduler again and return them as a
        `TrainState` (samplers may be left out: the loop keeps the ones it has). The loop puts them into `state`
        and loads them from the in-memory snapshots, re-sharded; read them from `state` (`state.model`,
        `state.optim`, `state.extras[...]`) inside the step. Without it, a smaller world restarts every worker.
        """
        session = self._session()
        if session.joining is not None:
            # A replacement built its model on a placeholder group: its memory first, then the real group.
            t0 = time.monotonic()
            touched = prepare_for_load(state.model, state.optim)
            session.join()
            if state.model is not None:
                rebind_fsdp(state.model, reset=False)
            log.info("joined generation %d after preparing the state (%.0f MB of parameters touched in %.2f s)",
                     session.in_place.generation if session.in_place else -1, touched / 1e6,
                     time.monotonic() - t0)
        cfg = _checkpoint_config(checkpoint, checkpoint_options, self._train_cfg.collective_timeout_s)
        self.loop = StepLoop(self, total, state, checkpoint=cfg, fingerprint=fingerprint, metadata=metadata,
                             audit_dir=audit_dir, log_every=log_every, on_step=on_step, init=init, rebuild=rebuild)
        return self.loop

    def guard(self) -> Any:
        """Wrap each step's body in it (`with w.guard():`) to let the job recover in place (`elastic.in_place`).

        When a peer rank dies, this process's collectives fail inside the step; in the guard that ends the step
        instead of the process: the loop drops the partial step, waits at the step boundary with everything in
        memory while the agent replaces the lost rank, rebuilds the process group, and continues from the newest
        in-memory snapshot (so use `checkpoint.snapshot_every_steps`). Other errors pass through. Without
        `elastic.in_place` it does nothing. Between `Worker` start and the loop, a script that recovers in place
        must run no collectives of its own: a replacement joins the others at the loop's start, and until then its
        process group is a placeholder on which a collective raises (it builds its model before anyone waits).
        """
        if self.loop is None:
            raise RuntimeError("Worker.guard is for use inside `for step in w.steps(...)`")
        return self.loop.guard()

    @contextmanager
    def section(self, name: str, timeout_s: Optional[float] = None) -> Iterator[None]:
        """Mark a part of your loop that is not a training step (an eval, a long data reload, a call to an outside
        service): the agent's hang rule holds it to its own timeout, not the step's.

        `timeout_s`: that timeout. None: calibrated from this section's earlier runs on the node (5 x the longest,
        at least the hang floor), and the agent's init allowance (600 s) until it has run 3 times. Heartbeats
        inside count as progress, so a long section may also call `w.section` around its own sub-parts.
        """
        if not name or (timeout_s is not None and not timeout_s > 0):
            raise ConfigError(f"Worker.section({name!r}, timeout_s={timeout_s}): give a name and a positive "
                              f"timeout_s (or None to calibrate it)")
        number = self._sections.get(name)
        if number is None:
            if len(self._sections) >= MAX_SECTIONS:
                raise ConfigError(f"Worker.section: more than {MAX_SECTIONS} section names; reuse names")
            number = self._sections[name] = len(self._sections)
            # The agent learns the name and timeout once (the beats carry only the number).
            self.heartbeat.event("section_declared", number=number, name=name, timeout_s=timeout_s)
        step = self.loop.state.step if self.loop is not None else 0
        outer = self.heartbeat.phase  # back to it after: "train", or an enclosing section
        self.heartbeat.beat(step, section_phase(number))
        try:
            yield
        finally:
            self.heartbeat.beat(step, outer)

    def report(self, **values: Any) -> None:
        """Add values (floats or 0-d tensors, e.g. `loss * mb.fraction`) to this step's reduction.

        Summed over the step's calls and over ranks in the step loop's one all_reduce (no extra collective);
        read them from `metrics` or `on_step`. Every rank must report the same names every step.
        """
        if self.loop is None:
            raise RuntimeError("Worker.report is for use inside `for step in w.steps(...)`")
        self.loop.report(values)


def _checkpoint_config(checkpoint: str | CheckpointConfig | None, options: dict[str, Any],
                       collective_timeout_s: float) -> Optional[CheckpointConfig]:
    if isinstance(checkpoint, CheckpointConfig):
        if options:
            raise ConfigError("Worker.steps: pass checkpoint options either in the CheckpointConfig or as keywords")
        validate_checkpoint(checkpoint, collective_timeout_s)
        return checkpoint
    if checkpoint is None and not options:
        return None
    if checkpoint is None and "url" not in options:
        raise ConfigError(f"Worker.steps: {', '.join(sorted(options))} given but no checkpoint URL; pass "
                          f"checkpoint='file:///path' (or a path) or 's3://bucket/prefix'")
    data = dict(options)
    if checkpoint is not None:
        data["url"] = str(checkpoint)
    return checkpoint_config(data, collective_timeout_s)
