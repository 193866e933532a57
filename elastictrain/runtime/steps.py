"""The step loop of the public API: resume, step boundaries the agent sees, saves, pause/drain/stop, one collective.

`Worker.steps(...)` returns a `StepLoop`; iterating it yields the index of the step about to run. Around the
user's step it

* before the first step: loads the newest valid checkpoint into the `TrainState` (or starts fresh), seeds each
  rank's RNG (restored from the checkpoint at the same world size, derived from (seed, step, rank) otherwise) and
  checks that every rank starts from the same step, data position, fingerprint and checkpoint;
* after each step: advances the `ElasticSampler`s of the state, records the step's samples in the sample ledger
  (when auditing), takes the in-memory snapshot when due (checkpoint.snapshot_every_steps), sends a heartbeat
  (so the agent's hang detector sees the user's steps), and runs **one small all_reduce** that sums the values
  passed to `Worker.report` together with three flags: a rank was asked to stop (SIGTERM/SIGINT, a drain),
  rank 0 relays an operator's "checkpoint now", a rank was asked to pause;
* then saves when due (async), or blocking when stopping or at the end; waits at the boundary while paused;
  ends the loop when a stop was agreed (every rank at the same step, state saved).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist

from elastictrain.config import CheckpointConfig, fingerprint_parts
from elastictrain.errors import CheckpointError, ConfigError
from elastictrain.runtime.audit import SampleLedger
from elastictrain.runtime.checkpointing import StateCheckpointer
from elastictrain.runtime.control import WorkerControl
from elastictrain.runtime.determinism import derive_seed, seed_everything
from elastictrain.runtime.heartbeat import Heartbeat
from elastictrain.runtime.injected_faults import maybe_inject
from elastictrain.runtime.inplace import GROW_SAVE_WAIT_S, InPlace, InPlaceFailed, StuckWatch, is_peer_failure
from elastictrain.runtime.steps_inplace import InPlaceLoop
from elastictrain.runtime.stragglers import MAX_WORLD, Change, StragglerWatch, config_from_env
from elastictrain.runtime.train_state import TrainState

log = logging.getLogger(__name__)

MAX_METRICS = 8
"""Names `Worker.report` may use per step: the step's one all_reduce has a fixed size."""
_FLAGS = 6
"""stop, checkpoint now, pause, the hash of the reported names, ready to re-form with a joining node, a durable save
owed from the boundary before (a grow's)."""
PROGRESS_EVERY_S = 5.0
"""Rank 0 reports a `progress` event (step, step time, reported values) this often, and at the last step."""
_PAUSE_POLL_S = 0.5
"""While paused, ranks agree on resume/stop this often."""

StepHook = Callable[[int, dict[str, float]], None]


class StopRequest(Protocol):
    requested: bool


class LoopHost(Protocol):
    """What the loop uses of its `Worker`."""

    seed: int
    heartbeat: Heartbeat
    control: WorkerControl
    stop_flag: StopRequest

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def is_main(self) -> bool: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def in_place(self) -> Optional[InPlace]: ...
    def rebuild_group(self, generation: int) -> bool: ...


def _names_hash(names: list[str]) -> int:
    """Small enough that a sum over thousands of ranks stays exact in float64."""
    return zlib.crc32("\0".join(names).encode()) & 0xFFFFF


class StepLoop(InPlaceLoop):
    """Iterate to train; see the module doc. Made by `Worker.steps`."""

    def __init__(self, worker: LoopHost, total: int, state: TrainState, *,
                 checkpoint: Optional[CheckpointConfig], fingerprint: Optional[dict[str, Any]],
                 metadata: Optional[dict[str, Any]], audit_dir: Optional[str], log_every: int,
                 on_step: Optional[StepHook], init: Optional[Callable[[], None]] = None,
                 rebuild: Optional[Callable[[], TrainState]] = None):
        if total < 0:
            raise ConfigError(f"Worker.steps: total={total} must be >= 0")
        self.worker, self.total, self.state = worker, total, state
        self.log_every, self.on_step, self._init, self._rebuild = log_every, on_step, init, rebuild
        self.metrics: dict[str, float] = {}
        """The values of `Worker.report`, summed over ranks, of the last finished step."""
        self.step_times: list[float] = []
        self.resumed_from: Optional[str] = None
        self.start_step = 0
        self.reporter = 0
        """The rank that reports this group's start (an in-place recovery's `in_place_resumed`): the lowest survivor."""
        self.stopped = self.stopped_by_peer = False
        self._pending: dict[str, Any] = {}
        self._fingerprint = fingerprint_parts(fingerprint or {})
        self.checkpointer: Optional[StateCheckpointer] = None
        self._checkpointer: Optional[Callable[[], StateCheckpointer]] = None
        if checkpoint is not None and checkpoint.url:
            self._checkpointer = lambda: StateCheckpointer(
                checkpoint, state, worker.heartbeat, rank=worker.rank, world_size=worker.world_size,
                fingerprint=self._fingerprint, metadata=metadata)
            self.checkpointer = self._checkpointer()
        self._guarded = False
        """`Worker.guard()` was used: a peer's failure inside the step pauses this process in place."""
        self._failure: Optional[BaseException] = None
        """The peer failure the guard caught in the step just run."""
        self.recoveries = 0
        """How often this process recovered in place."""
        # The first step is reported at once (a short-lived group still shows on the dashboard), then every 5 s.
        self._progress_at, self._progress_steps = -math.inf, 0
        self._stuck: Optional[StuckWatch] = None
        self._pausing = False
        self._pause_parts: dict[str, float] = {}  # where the last in-place pause went (steps_inplace.py)
        self._save_owed = False
        """A durable save was due at a boundary where the group re-formed (a grow): it is made at the next step."""
        self._audit_dir = audit_dir
        self.ledger: Optional[SampleLedger] = None
        self._launch_seq = 0
        self._started = False
        self._stragglers: Optional[StragglerWatch] = None
        self._forward_hook: Any = None
        self._watch_stragglers()

    def _watch_stragglers(self) -> None:
        """Straggler timings: when this step's ranks left the last all_reduce, and this rank's first forward since."""
        worker, state = self.worker, self.state
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._stragglers = (StragglerWatch(worker.world_size, config_from_env())
                            if 1 < worker.world_size <= MAX_WORLD else None)
        self._released, self._first_forward = time.monotonic(), 0.0
        if self._stragglers is not None and state.model is not None:
            # In front of FSDP's own pre-forward hook, whose all-gather is the step's first collective.
            self._forward_hook = state.model.register_forward_pre_hook(self._on_forward, prepend=True)

    # --- user side ---------------------------------------------------------------------------------------

    def report(self, values: dict[str, Any]) -> None:
        for name, v in values.items():
            v = v.detach() if isinstance(v, torch.Tensor) else v
            self._pending[name] = self._pending[name] + v if name in self._pending else v

    @contextmanager
    def guard(self) -> Iterator[None]:
        """The body of a step: with `elastic.in_place`, a collective that fails because a peer went away ends the
        step early instead of the process; the loop then waits in place for the peer's replacement (inplace.py)."""
        self._guarded = True
        try:
            yield
        except Exception as e:
            if not self._recoverable(e):
                raise
            self._failure = e

    def _recoverable(self, e: BaseException) -> bool:
        return (self.worker.in_place is not None and self._guarded and self._checkpointer is not None
                and is_peer_failure(e))

    def __iter__(self) -> Iterator[int]:
        if self._started:
            raise RuntimeError("a StepLoop runs once; call worker.steps(...) again for another loop")
        self._started = True
        return self._run()

    # --- the loop ------------------------------------------------------------------------------------------

    def _run(self) -> Iterator[int]:
        w, st = self.worker, self.state
        finished = False
        try:
            self._start()
            if st.step >= self.total and w.is_main:
                log.warning("already at step %d of %d (resumed from %s): nothing to train; to start over, use "
                            "another checkpoint URL or resume='never'", st.step, self.total, self.resumed_from)
            while st.step < self.total:
                maybe_inject(st.step, w.rank, w.world_size)
                t0 = time.monotonic()
                yield st.step
                done = False
                if self._failure is None:
                    try:
                        done = self._end_step(t0)
                    except Exception as e:
                        if not self._recoverable(e):
                            raise
                        self._failure = e
                if self._failure is not None:
                    self._recover()
                elif done:
                    break
            finished = True
        finally:
            w.heartbeat.beat(st.step, "done" if finished else "train")
            if finished:
                self.close(wait=True)
            # Else the user left the loop early (break), or an exception is on its way out (a peer died: an async
            # save in flight may wait forever on it). No save is made; the Worker decides, when its block ends,
            # whether to wait for the save in flight (no error) or not (`close`).

    def close(self, wait: bool) -> None:
        """End the loop's checkpointing: wait for the save in flight (`wait`), or abandon it (an error is on its
        way out: its collectives may never complete); close the sample ledger. Idempotent."""
        if self._stuck is not None:
            self._stuck.stop()
            self._stuck = None
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        if self.checkpointer is not None:
            if wait:
                self.checkpointer.close()
            self.checkpointer = None
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None

    def _start(self, recovering: bool = False) -> None:
        w, st = self.worker, self.state
        w.heartbeat.beat(st.step, "load")
        t0 = time.monotonic()
        resumed = self.checkpointer.restore() if self.checkpointer is not None else None
        self._pause_parts["restore"] = time.monotonic() - t0
        if resumed is None and recovering:
            raise InPlaceFailed("no snapshot or checkpoint to resume from in place (a failure before the first one); "
                                "restarting every worker instead")
        if resumed is None:
            if self._init is not None:
                w.heartbeat.beat(st.step, "init")
                self._init()
            seed_everything(derive_seed(w.seed, "rank", w.rank))
        else:
            self.resumed_from = resumed.source
            if resumed.reseed:
                # This rank's RNG was not in the checkpoint (another world size): derive it from (seed, step, rank).
                seed_everything(derive_seed(w.seed, "resume", st.step, w.rank))
        if w.in_place is not None:
            self._agree_generation(w.in_place)
            if self._stuck is None and self._guarded_loop():
                self._stuck = StuckWatch(w.in_place, pausing=lambda: self._pausing, grace=self._stuck_grace).start()
        survived = self._verify_consistent_start(in_place=recovering)
        if w.in_place is not None and w.in_place.replacement and not survived and w.rank == 0:
            self._record_formed_without_survivors(w.in_place)
        self.start_step = st.step
        if self._audit_dir is not None:
            # Identifies this launch in the ledger; newer launches (after a restart) supersede older ones.
            seq = torch.tensor([time.time_ns()], dtype=torch.int64)
            if w.world_size > 1:
                dist.broadcast(seq, src=0)
            self._launch_seq = int(seq.item())
            self.ledger = SampleLedger(Path(self._audit_dir), w.rank, f"{self._launch_seq:x}")
        w.heartbeat.beat(st.step, "train")
        self._released, self._first_forward = time.monotonic(), 0.0

    def _verify_consistent_start(self, in_place: bool = False) -> bool:
        """Fail loudly unless every rank starts from the same step, data position, fingerprint and checkpoint.

        ``in_place``: this rank resumes in place (a survivor, not a replacement). The lowest such rank reports the
        recovery (`reporter`): rank 0 when it survived, else another survivor, since a replaced rank 0 knows neither
        the pause nor the old generation. Returns whether any rank of the group survived so."""
        w, st = self.worker, self.state
        mine = (st.step, [s.samples_consumed for s in st.samplers], sorted(self._fingerprint.items()),
                self.resumed_from)
        self.reporter = 0
        if w.world_size == 1:
            return in_place
        gathered: list[Any] = [None] * w.world_size
        dist.all_gather_object(gathered, (mine, in_place))
        views = [g[0] for g in gathered]
        self.reporter = next((r for r, g in enumerate(gathered) if g[1]), 0)
        if any(v != views[0] for v in views):
            detail = "; ".join(f"rank {r}: step {v[0]}, samples {v[1]}, checkpoint {v[3]}" for r, v in enumerate(views))
            raise CheckpointError(f"ranks disagree on the starting state after (re)load: {detail}. Check that "
                                  f"every node runs the same script, config and checkpoint URL")
        return any(g[1] for g in gathered)

    def _end_step(self, t0: float) -> bool:
        """Close the step the user just ran; True when the loop must end (a stop agreed by every rank)."""
        w, st = self.worker, self.state
        if self.ledger is not None:
            samples = [s for sampler in st.samplers for s in sampler.last_planned]
            self.ledger.record(st.step, w.world_size, self._launch_seq, samples)
        for sampler in st.samplers:
            sampler.advance()
        st.step += 1
        # The step is computed on this rank (and in the sample ledger): say so before the all_reduce, so that a fault
        # inside it is charged at this step, as the sample ledger counts it (the time ledger's recomputed steps).
        w.heartbeat.beat(st.step, "train")
        if self.checkpointer is not None:
            self.checkpointer.snapshot_if_due(final=st.step == self.total)
        stop, ckpt_now, pause, grow, owed = self._reduce()
        self.step_times.append(time.monotonic() - t0)
        self._progress_steps += 1
        if self.on_step is not None:
            self.on_step(st.step, self.metrics)
        if self.log_every and (st.step % self.log_every == 0 or st.step == self.total) and w.is_main:
            self._log_progress()
        if w.is_main and (time.monotonic() - self._progress_at >= PROGRESS_EVERY_S or st.step == self.total):
            self._report_progress()
        final = st.step == self.total
        if self.checkpointer is not None:
            self._save_owed = self.checkpointer.after_step(final=final, stopping=stop, owed=owed,
                                                           regrouping=grow and not stop and not final)
            if ckpt_now and not stop:
                self.checkpointer.save_now()
        if ckpt_now:
            w.control.ckpt_handled()
        if pause and not stop and not final:
            stop = self._pause()
            if stop and self.checkpointer is not None:
                self.checkpointer.after_step(final=False, stopping=True)
        if grow and not stop and not final:
            self._join_grown()
            return False
        if stop and not w.stop_flag.requested and (generation := self._peer_left()) is not None:
            self._leave_peer(generation)
            return False
        if stop:
            self.stopped = True
            self.stopped_by_peer = not w.stop_flag.requested
            why = " for a re-form" if w.control.reform_requested else " by another rank" if self.stopped_by_peer else ""
            log.warning("stop requested%s: leaving at step %d", why, st.step)
        return stop

    def _reduce(self) -> tuple[bool, bool, bool, bool, bool]:
        """The step's one collective: reported values summed, and the stop/checkpoint/pause/grow/save-owed flags.

        The owed save is agreed here like the others: only the ranks that were in the group at the grow's boundary
        owe it, and its save is a collective (a rank that joined there would otherwise never enter it, and both
        ranks would wait in different collectives until the hang detector restarted every worker)."""
        w = self.worker
        names = sorted(self._pending)
        if len(names) > MAX_METRICS:
            raise ConfigError(f"Worker.report: {len(names)} names in one step ({', '.join(names)}); at most "
                              f"{MAX_METRICS}: report fewer values")
        w.control.poll()
        # A re-form the agent asked for (a straggler's replacement) stops every rank like a drain: save, exit.
        flags = [float(w.stop_flag.requested or w.control.reform_requested),
                 float(w.rank == 0 and w.control.ckpt_requested),
                 float(w.control.paused), float(_names_hash(names)),
                 float(self._grow_now()), float(self._save_owed)]
        timed = _FLAGS + MAX_METRICS  # then this step's prelude and busy time of each rank (stragglers.py)
        vec = torch.zeros(timed + (2 * w.world_size if self._stragglers else 0), dtype=torch.float64, device=w.device)
        vec[:_FLAGS] = torch.tensor(flags, dtype=torch.float64)
        for i, name in enumerate(names):
            vec[_FLAGS + i] = self._pending[name]
        if self._stragglers is not None:
            now = time.monotonic()
            vec[timed + w.rank] = max(0.0, self._first_forward - self._released) if self._first_forward else 0.0
            vec[timed + w.world_size + w.rank] = now - self._released
        if w.world_size > 1:
            dist.all_reduce(vec)
        out = vec.tolist()
        if self._stragglers is not None:
            released, self._released, self._first_forward = self._released, time.monotonic(), 0.0
            if w.is_main:  # every rank sends its timings; only rank 0 judges and reports them
                n = w.world_size
                self._report_stragglers(self._stragglers.observe(
                    self.state.step, out[timed:timed + n], out[timed + n:timed + 2 * n], self._released - released))
        self._pending = {}
        if out[3] != flags[3] * w.world_size:
            raise ConfigError(f"Worker.report: the ranks reported different names at step {self.state.step} (rank "
                              f"{w.rank}: {names or 'none'}); report the same names on every rank at every step")
        self.metrics = {name: out[_FLAGS + i] for i, name in enumerate(names)}
        return out[0] > 0, out[1] > 0, out[2] > 0, out[4] > w.world_size - 0.5, out[5] > 0

    def _grow_now(self) -> bool:
        """This rank is ready to re-form with a node that joins (a grow): its watch saw the new workers ready, and no
        durable save of its is in flight (the re-form would wait for it; the new workers wait a step or two instead),
        or one has been for `GROW_SAVE_WAIT_S`. Every rank must be: the flags are summed."""
        ip = self.worker.in_place
        if ip is None or ip.grow_ready is None:
            return False
        if ip.generation is not None and ip.grow_ready <= ip.generation:
            ip.grow_ready = None  # the watch saw it just before this rank re-formed into it (or past it)
            return False
        saving = self.checkpointer is not None and self.checkpointer.saving
        return not saving or time.monotonic() - ip.grow_ready_at > GROW_SAVE_WAIT_S

    def _on_forward(self, *_: Any) -> None:
        if not self._first_forward:
            self._first_forward = time.monotonic()

    def _report_stragglers(self, changes: list[Change]) -> None:
        """Log and report each change (rank 0: an event, which `status` and the metrics endpoint show)."""
        for c in changes:
            # `rank` on an event is the reporting rank's (the agent sets it): the slow one is `slow_rank`.
            fields = {"slow_rank": c.rank, "step": c.step, "lateness_s": round(c.lateness_s, 4),
                      "score": round(c.score, 3)}
            if c.confirmed:
                # `saves`: whether the state is saved at a stop; without, a replacement would lose the progress.
                log.warning("rank %d is still a straggler %d steps after it was named: %.3fs late per step",
                            c.rank, self._stragglers.config.confirm_steps if self._stragglers else 0, c.lateness_s)
                self.worker.heartbeat.event("straggler_confirmed", **fields, saves=self.checkpointer is not None)
                continue
            if c.slow:
                log.warning("rank %d is a straggler: %.3fs late per step (%.0f%% of the step time) over the last "
                            "steps up to %d", c.rank, c.lateness_s, 100 * c.score, c.step)
            else:
                log.info("rank %d is no longer a straggler (step %d)", c.rank, c.step)
            self.worker.heartbeat.event("straggler" if c.slow else "straggler_cleared", **fields)

    def _pause(self) -> bool:
        """Wait at this step boundary until no rank is asked to pause; True when a stop was agreed meanwhile.

        Every rank loops in lockstep on a small all_reduce, so all leave at the same iteration. A "checkpoint
        now" while paused is saved at once (pause, save, then drain is the planned-maintenance sequence).
        """
        w, step = self.worker, self.state.step
        if w.is_main:
            log.warning("paused at step %d by operator request", step)
        while True:
            w.heartbeat.beat(step, "paused")
            time.sleep(_PAUSE_POLL_S)
            w.control.poll()
            ckpt = w.rank == 0 and w.control.ckpt_requested
            stop = w.stop_flag.requested or w.control.reform_requested
            red = torch.tensor([float(w.control.paused), float(stop), float(ckpt)], device=w.device)
            if w.world_size > 1:
                dist.all_reduce(red)
            paused, stop, ckpt_now = red.tolist()
            if ckpt_now:
                if self.checkpointer is not None:
                    self.checkpointer.save_now()
                w.control.ckpt_handled()
            if stop or not paused:
                if w.is_main:
                    log.warning("%s at step %d", "stop requested while paused" if stop else "resumed", step)
                w.heartbeat.beat(step, "train")
                self._released, self._first_forward = time.monotonic(), 0.0
                return bool(stop)

    def _report_progress(self) -> None:
        """Rank 0: the step, the median step time since the last report and the reported values (summed over ranks) as
        a `progress` event, which the dashboard plots (loss, tokens/s when the script reports `tokens`)."""
        recent = self.step_times[-max(1, self._progress_steps):] if self.step_times else []
        self._progress_at, self._progress_steps = time.monotonic(), 0
        if not recent:
            return
        self.worker.heartbeat.event("progress", step=self.state.step, step_time_s=round(statistics.median(recent), 4),
                                    **{k: round(float(v), 6) for k, v in self.metrics.items()})

    def _log_progress(self) -> None:
        recent = self.step_times[-self.log_every:]
        median = statistics.median(recent)
        values = " ".join(f"{k} {v:.4g}" for k, v in self.metrics.items())
        log.info("step %d/%d %s%sstep_time %.3fs", self.state.step, self.total, values, " " if values else "", median)
