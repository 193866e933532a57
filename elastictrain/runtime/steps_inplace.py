"""The step loop's in-place side (`elastic.in_place`, runtime/inplace.py): pausing on a peer's failure, going on
without a drained peer, rebuilding the process group (and, in a smaller world, the model) and resuming from the
newest snapshot. A mixin of `StepLoop` (runtime/steps.py), whose state it uses."""

from __future__ import annotations

import gc
import logging
import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from elastictrain.errors import ConfigError
from elastictrain.runtime.inplace import InPlace, InPlaceFailed, record_formed, shut_group_sockets
from elastictrain.runtime.train_state import TrainState

log = logging.getLogger("elastictrain.runtime.steps")

STUCK_GRACE_S = 10.0
"""The least time a survivor gets to reach the pause after a peer was replaced (3 step times when longer)."""


def _short_cause(exc: Optional[BaseException]) -> str:
    """gloo's one line without its source location and advice: "Read error [127.0.0.1]:50087: Connection reset by
    peer"."""
    text = str(exc).splitlines()[0] if exc is not None and str(exc) else type(exc).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0][:300]


class InPlaceLoop:
    """What `StepLoop` does in place; see the module doc."""

    worker: Any
    state: TrainState
    step_times: list[float]
    recoveries: int
    reporter: int
    checkpointer: Any
    ledger: Any
    _checkpointer: Optional[Callable[[], Any]]
    _rebuild: Optional[Callable[[], TrainState]]
    _failure: Optional[BaseException]
    _guarded: bool
    _pausing: bool
    _pending: dict[str, Any]
    _pause_parts: dict[str, float]

    def _start(self, recovering: bool = False) -> None: ...
    def _watch_stragglers(self) -> None: ...

    @property
    def can_rebuild(self) -> bool:
        """The script gave `rebuild`: the loop can go on in place in a smaller world."""
        return self._rebuild is not None

    def rebuild_state(self, shrank: bool = True) -> None:
        """The world changed size in place: the model, optimizer and scheduler built again on the new mesh
        (`rebuild`), put into the state; the load from the snapshots that follows fills them. `shrank`: fewer ranks
        now, so each one's shards grow."""
        assert self._rebuild is not None
        t0 = time.monotonic()
        old = self.state.model
        self.state.model = self.state.optim = None  # the old shards go before the new ones are allocated
        del old
        if shrank:
            # FSDP's modules hold their parameters in reference cycles: without a collection the old shards stay
            # beside the larger new ones until the next full one. It costs the pause 0.1-0.2 s (50M), so a grow,
            # whose new shards are smaller, leaves them to the next automatic collection.
            gc.collect()
        collected = time.monotonic() - t0
        new = self._rebuild()
        if not isinstance(new, TrainState):
            raise ConfigError(f"Worker.steps(rebuild=...) returned {type(new).__name__}; return a TrainState with the "
                              f"model built on w.mesh, its optimizer and scheduler")
        self.state.adopt(new)
        self._watch_stragglers()
        self._pause_parts["model"] = time.monotonic() - t0
        log.info("model, optimizer and scheduler built again on the new mesh in %.2fs (the old ones collected in "
                 "%.2fs)", self._pause_parts["model"], collected)

    def _record_formed_without_survivors(self, in_place: InPlace) -> None:
        """Rank 0 of a group that no rank survived into: when it is a grow's world (its only survivor failed while the
        grow was pending, and the agent replaced it into that grow's generation), record the grow formed, as a
        survivor re-forming it would: a failure from now on is replaced in place, not by a restart of every worker."""
        generation = in_place.generation
        if generation is None:
            return
        try:
            world = in_place.world_at(generation)
            if world is not None and world.joined and world.generation == generation:
                record_formed(in_place.store, generation)
                log.info("the grow of generation %d formed with the replacement of its only survivor", generation)
        except Exception as e:  # noqa: BLE001 - etcd blinked: a failure meanwhile restarts every worker
            log.warning("could not record that generation %d formed: %s", generation, e)

    def _agree_generation(self, in_place: InPlace) -> None:
        """Every rank runs in rank 0's generation: the one it joined or rebuilt, or on a first start the counter's."""
        gen = torch.tensor([in_place.generation if in_place.generation is not None else
                            (in_place.read_generation() if self.worker.rank == 0 else 0)], dtype=torch.int64)
        if self.worker.world_size > 1:
            dist.broadcast(gen, src=0)
        in_place.generation = int(gen.item())

    def _guarded_loop(self) -> bool:
        """Whether this loop can pause in place: a checkpoint to continue from (the guard is checked as it is used)."""
        return self._checkpointer is not None

    def _stuck_grace(self) -> float:
        """How long a survivor may stay in a collective after a peer was replaced: a step's local compute runs
        before it reaches the next collective, which is where the peer's death shows."""
        recent = self.step_times[-20:]
        return max(STUCK_GRACE_S, 3 * statistics.median(recent)) if recent else STUCK_GRACE_S

    def _recover(self) -> None:
        """A peer failed in the step just run: drop the step, wait here for its replacement, rebuild the process
        group, and continue from the newest snapshot every rank holds (runtime/inplace.py)."""
        w, st = self.worker, self.state
        exc, self._failure = self._failure, None
        in_place = w.in_place
        assert in_place is not None and self._checkpointer is not None
        failed_step, started = st.step, time.monotonic()
        self._pausing = True
        cause = _short_cause(exc)
        del exc  # its traceback holds the step's frames, and with them the model: a smaller world builds a new one
        log.warning("a peer failed during step %d (%s): paused in place until its rank is replaced", failed_step,
                    cause)
        w.heartbeat.beat(failed_step, "paused")
        shut_group_sockets()  # a peer blocked on this rank, not on the failed one, fails too and pauses with us
        if self.checkpointer is not None:
            self.checkpointer.abandon()
            self.checkpointer = None
        generation = in_place.wait_next(beat=lambda: w.heartbeat.beat(failed_step, "paused"),
                                        stop=lambda: w.stop_flag.requested)
        self._resume_in_place(generation, failed_step, started, cause)

    def _peer_left(self) -> Optional[int]:
        """A stop asked by a peer (a drain) whose node left the running round for good, recorded as a smaller world
        that this rank is part of (rendezvous/shrink.py): that world's generation, to go on in place; else None
        (the stop stands: save, exit, re-form)."""
        w = self.worker
        in_place = w.in_place
        if (in_place is None or not in_place.settings.shrink or not self.can_rebuild or self._checkpointer is None
                or not self._guarded or w.control.reform_requested or in_place.generation is None):
            return None
        try:
            newest = in_place.read_generation()
            world = in_place.world_at(newest) if newest > in_place.generation else None
        except Exception as e:  # noqa: BLE001 - etcd unreachable: the stop stands, the agents re-form
            log.warning("could not read whether the stopping peer left in place: %s", e)
            return None
        if world is None or world.generation <= in_place.generation or world.rank_of(in_place.round_rank) is None:
            return None
        return newest

    def _leave_peer(self, generation: int) -> None:
        """A peer node drained (its state saved with ours at this step boundary): go on without it, in place."""
        w, st = self.worker, self.state
        step, started = st.step, time.monotonic()
        self._pausing = True
        log.warning("a peer node left at step %d (a drain): going on without it in place", step)
        w.heartbeat.beat(step, "paused")
        if self.checkpointer is not None:
            self.checkpointer.close()  # the stop's save is done: nothing in flight
            self.checkpointer = None
        self._resume_in_place(generation, step, started, "a peer node drained")

    def _join_grown(self) -> None:
        """A node took a lost node's place back (rendezvous/shrink.py) and its workers wait for this group: every rank
        stops at this step boundary with this step's snapshot taken, then all re-form the bigger world in place."""
        w, st = self.worker, self.state
        in_place = w.in_place
        assert in_place is not None
        generation = torch.tensor([in_place.grow_ready or 0], dtype=torch.int64)
        if w.world_size > 1:  # every rank's watch saw a grow (the flag needs all); the newest one, should they differ
            dist.all_reduce(generation, op=dist.ReduceOp.MAX)
        in_place.grow_ready = None
        step, started = st.step, time.monotonic()
        self._pausing = True
        log.warning("a node's workers wait to join at step %d: re-forming a bigger world in place", step)
        w.heartbeat.beat(step, "paused")
        live = None
        if self.checkpointer is not None:
            # A bigger world builds a new model (`rebuild_state`) and leaves the old one's tensors as they are: the
            # new group can read this step's snapshot from them instead of waiting for its copy.
            try:
                world = in_place.world_at(int(generation.item()))
            except Exception as e:  # noqa: BLE001 - etcd unreachable: the re-form meets it and falls back
                log.debug("could not read the grown world's size: %s", e)
                world = None
            live = self.checkpointer.hand_over(live=world is not None and world.size > w.world_size)
            self.checkpointer = None
        self._resume_in_place(int(generation.item()), step, started, "a node joined", live=live)

    def _resume_in_place(self, generation: int, failed_step: int, started: float, cause: str,
                         live: Any = None) -> None:
        """Rebuild the process group of `generation` (a smaller world: the model too) and continue from the newest
        snapshot every rank holds (`live`: one served from the group before's state, `StateCheckpointer.live`)."""
        w, st = self.worker, self.state
        in_place = w.in_place
        assert in_place is not None and self._checkpointer is not None
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None
        self._pending = {}
        old, old_world = in_place.generation, w.world_size
        parts = self._pause_parts = {"wait": time.monotonic() - started}
        try:
            t0 = time.monotonic()
            w.rebuild_group(generation)
            parts["group"] = time.monotonic() - t0 - parts.get("model", 0.0)
            self.checkpointer = self._checkpointer()
            if self.checkpointer is not None:
                self.checkpointer.live = live
            del live
            t0 = time.monotonic()
            self._start(recovering=True)
            parts["check"] = time.monotonic() - t0 - parts.get("restore", 0.0)
        except InPlaceFailed:
            raise
        except Exception as e:
            raise InPlaceFailed(f"rebuilding the process group in place failed: {type(e).__name__}: {e}") from e
        self.recoveries += 1
        self._pausing = False
        pause = time.monotonic() - started
        if w.world_size > old_world and w.rank == self.reporter:
            try:  # the grow's new workers hold state from here on: a failure now is replaced in place again
                record_formed(in_place.store, generation)
            except Exception as e:  # noqa: BLE001 - etcd blinked: a failure meanwhile restarts every worker
                log.warning("could not record that generation %d formed: %s", generation, e)
        if w.rank == self.reporter:  # the lowest survivor: rank 0 may be a replacement, which knows no pause
            log.warning("resumed in place at step %d (generation %d) after %.2fs paused (%s)", st.step, generation,
                        pause, ", ".join(f"{k} {v:.2f}s" for k, v in parts.items()))
            w.heartbeat.event("in_place_resumed", generation=generation, failed_step=failed_step, step=st.step,
                              pause_s=round(pause, 3), cause=cause,
                              parts={k: round(v, 3) for k, v in parts.items()},
                              **({"from_world_size": old_world, "to_world_size": w.world_size}
                                 if old_world != w.world_size else {}),
                              **({"grew": True} if w.world_size > old_world else {}))
            if old is not None:
                in_place.forget(old)
