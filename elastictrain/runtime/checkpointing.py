"""Between the step loop and the CheckpointManager: what to save, when, and how to resume a `TrainState`."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from elastictrain.checkpoint.manager import CheckpointManager, EventSink
from elastictrain.checkpoint.replica_fetch import Offer, fetch_offer, find_offers
from elastictrain.checkpoint.snapshot import ENV_SNAPSHOT_DIR, LiveSnapshot, SnapshotInfo, SnapshotStore, storage_key
from elastictrain.checkpoint.snapshot_budget import SnapshotRoomError, room_check
from elastictrain.checkpoint.snapshot_reshard import (
    Candidate,
    Holding,
    Reshard,
    newest_complete,
    node_name,
    read_shards,
    scan,
)
from elastictrain.config import CheckpointConfig
from elastictrain.errors import SnapshotError, SnapshotReplicaError
from elastictrain.runtime.heartbeat import Heartbeat
from elastictrain.runtime.snapshot_pacing import TARGET_COST, Pace, SnapshotPacer, remember, remembered
from elastictrain.runtime.train_state import TrainState

log = logging.getLogger(__name__)


def event_sink(heartbeat: Heartbeat, rank: int) -> EventSink:
    """Checkpoint events: logged on every rank, and sent to the job's event log (etcd, via the agent) by rank 0.

    Every rank sees a save or a load alike (DCP makes one rank's failure every rank's), and the events that
    only one rank reports come from rank 0: rank 0's copy is the whole story, once.
    """
    def sink(name: str, fields: dict[str, Any]) -> None:
        log.debug("event %s %s", name, fields, extra={"fields": {"event": name, **fields}})
        if rank == 0:
            # Durations to the millisecond: what an operator reads, and a shorter datagram.
            heartbeat.event(name, **{k: round(v, 3) if isinstance(v, float) else v for k, v in fields.items()})
    return sink


@dataclass(frozen=True)
class Resumed:
    """Where the state came from: a checkpoint URL or `snapshot:step-N`; `reseed`: this rank's RNG was not in it."""

    source: str
    step: int
    reseed: bool


@dataclass(frozen=True)
class _Held:
    """What one rank could restore from: the steps of its snapshots (its own, or a peer's copy), and why any other
    snapshot it found does not serve; its node, and (one rank per node) the node's slots at any world size."""

    steps: tuple[int, ...]
    why: tuple[str, ...]
    node: str = ""
    slots: tuple[Holding, ...] = ()


def _none_in_common(held: list[_Held], shown: int = 8) -> str:
    """Why no snapshot serves: what each rank holds (the first few ranks)."""
    parts = [f"rank {r}: {', '.join(map(str, h.steps)) or 'none'}" + (f" ({'; '.join(h.why)})" if h.why else "")
             for r, h in enumerate(held[:shown])]
    more = f"; {len(held) - shown} more ranks" if len(held) > shown else ""
    return f"no step is held by every rank ({'; '.join(parts)}{more})"


class StateCheckpointer:
    """Saves a `TrainState` on the configured schedule, at the end and on a stop, and snapshots it in node memory
    (checkpoint.snapshot_every_steps, under our agent); restores from the newest of both tiers."""

    def __init__(self, cfg: CheckpointConfig, state: TrainState, heartbeat: Heartbeat, *, rank: int,
                 world_size: int, fingerprint: dict[str, str], metadata: Optional[dict[str, Any]] = None):
        self.cfg, self.state, self.heartbeat, self.rank, self.world_size = cfg, state, heartbeat, rank, world_size
        self._emit = event_sink(heartbeat, rank)
        self.mgr = CheckpointManager(cfg, fingerprint=fingerprint, rank=rank, world_size=world_size,
                                     on_event=self._emit, extra_metadata=metadata)
        self._last_saved: Optional[int] = None
        """The newest step whose save started (staged, for an async one) and did not fail there."""
        self._resumed: Optional[int] = None
        """The durable checkpoint's step this run resumed from."""
        self.snapshots: Optional[SnapshotStore] = None
        self._snapshot_step: Optional[int] = None
        """The step of the newest snapshot that was started and did not fail at once."""
        self._durable_pending: Optional[int] = None
        """A durable save due at this step, to be written from its snapshot once that is committed."""
        self._hook: Optional[RemovableHandle] = None
        self._pacer: Optional[SnapshotPacer] = None
        self._pace_key: tuple = ()
        """(run, config fingerprint, world size): what the pace this process decided is remembered under."""
        self._fresh = state.step == 0
        """A run from its start, nothing restored: snapshots that do not fit stop it (a ConfigError at start-up);
        once it trained or resumed, they are skipped and retried instead (`_no_room`) and the durable tier goes on."""
        self._no_room_since: Optional[int] = None
        """The step from which this node's snapshots have not fit (`_no_room`), while they do not."""
        self.live: Optional[LiveSnapshot] = None
        """A grow in place: the snapshot the group before took at the boundary, its copy cancelled, served from
        the live state (`hand_over(live=True)`); the next `restore` offers it, then drops it."""
        self._local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        """The workers on this node (a grow serves a snapshot from the live state only where it is the one)."""
        root = os.environ.get(ENV_SNAPSHOT_DIR)
        if cfg.snapshot_every_steps and root:
            identity = {"run": os.environ.get("TORCHELASTIC_RUN_ID", ""), "fingerprint": fingerprint,
                        "world_size": world_size, "url": cfg.url}
            # Durable saves are written from the snapshots, not staged from the live state (thread mode: the
            # process-based checkpointer would copy the slots into its own shared memory first).
            self.mgr.saves_from_snapshots = bool(cfg.url) and cfg.async_save and cfg.async_mode == "thread"
            # With more than one node in this world, the agent also keeps a peer node's replicas in this folder (a
            # survivor re-formed in place keeps its start's environment: the world it trains in says).
            room = room_check(cfg.snapshot_memory, Path(root), self._local_ranks,
                              replica=world_size > self._local_ranks, durable=self.mgr.saves_from_snapshots,
                              fatal=lambda: self._fresh)
            self.snapshots = SnapshotStore(root, rank, identity, check_room=room)
            # Without a run id (not under an agent) nothing tells two jobs of this process apart: nothing carried.
            self._pace_key = (identity["run"], json.dumps(fingerprint, sort_keys=True, default=str), world_size) \
                if identity["run"] else ()
            self._pacer = SnapshotPacer(cfg.snapshot_every_steps, agree=self.mgr.agree_max,
                                        carried=remembered(self._pace_key))
            # Parameters and optimizer state are copied while the next step's forward and backward run; its
            # optimizer step waits for the copy (a global pre-hook: any optimizer, the user's own included).
            self._hook = register_optimizer_step_pre_hook(lambda *_: self._finish_snapshot())
        elif cfg.snapshot_every_steps and rank == 0:
            log.info("checkpoint.snapshot_every_steps is set but this worker was not started by our agent "
                     "(no %s): no in-memory snapshots", ENV_SNAPSHOT_DIR)

    def _all_gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def restore(self) -> Optional[Resumed]:
        """Load the newest state that exists (a snapshot every rank holds, or a durable checkpoint); None: fresh."""
        try:
            resumed = self._restore_snapshot()
        finally:
            self.live = None  # its tensors are the group before's: freed once read
        if resumed is not None:
            self._fresh = False
            self._prepare_snapshots()
            return resumed
        loaded = self.mgr.load_latest(self.state.checkpoint_state(self.rank, for_load=True))
        if loaded is None:
            return None
        self._last_saved = self._resumed = loaded.step
        self._fresh = False
        self._prepare_snapshots()
        return Resumed(loaded.url, loaded.step, bool(loaded.missing_keys) or loaded.world_size != self.world_size)

    def _prepare_snapshots(self) -> None:
        """After a restore the state's size is known: the snapshot slots are mapped for it in the background
        (`SnapshotStore.prepare`). A grow in place right after a re-form waits for the first save's copy."""
        if self.snapshots is None:
            return
        try:
            self.snapshots.prepare(self.state.checkpoint_state(self.rank, reuse=True))
        except Exception as e:  # noqa: BLE001 - an optimisation: the saves map their slots themselves
            log.debug("snapshot slots not prepared after the restore: %s", e)

    def _restore_snapshot(self) -> Optional[Resumed]:
        if self.snapshots is None or self.cfg.resume != "auto":
            return None
        root = self.snapshots.dir.parent
        mine, why = self.snapshots.available()
        offers: dict[int, Offer] = {}
        if not mine:  # a lost node's rank, or one that moved at a re-form: a peer's agent may hold its snapshot
            offers, more = find_offers(root, self.rank, self.snapshots.identity)
            why += more
        # One rank per node lists the node's slots of every world size (a re-form at another size reshards them).
        slots = tuple(scan(root, self.snapshots.identity)) if os.environ.get("LOCAL_RANK", "0") == "0" else ()
        if self.live is not None:  # after those of its slot: the live one is kept should its copy have committed
            slots += (Holding(node_name(root), f"rank{self.live.rank}", self.live.rank,
                              self.live.info.identity["world_size"], self.live.info, live=True),)
        held = self._all_gather(_Held(tuple(sorted({i.step for i in mine} | set(offers))), tuple(why),
                                      node_name(root), slots))
        common = set(held[0].steps).intersection(*(h.steps for h in held[1:]))
        other, lacking = newest_complete([s for h in held for s in h.slots], self.world_size)
        if other is not None and other.step > max(common, default=-1):
            return self._restore_resharded(other, held)
        if not common:
            if any(h.steps or h.why for h in held) or lacking:
                self._skip_snapshot(None, "; ".join(filter(None, (_none_in_common(held), lacking))))
            return None
        step = max(common)
        durable = self.mgr.newest_step()
        if durable is not None and durable > step:
            return None  # at the same step the snapshot is read instead: the same state, from memory
        state = self.state.checkpoint_state(self.rank, for_load=True)
        local = next((i for i in mine if i.step == step), None)
        source = "" if local is not None else offers[step].peer.node
        try:
            self.snapshots.restore(local or self._fetch(offers[step]), state)
            error = None
        except (ValueError, SnapshotReplicaError) as e:
            error = str(e)
        outcomes = self._all_gather((error, source))
        errors = [e for e, _ in outcomes]
        if not any(errors):
            fetched = sorted({s for _, s in outcomes if s})
            log.info("resumed from the in-memory snapshot of step %d (newest durable checkpoint: %s)%s", step, durable,
                     f"; ranks without it copied it from node(s) {', '.join(fetched)}" if fetched else "")
            peers = {"fetched_ranks": sum(1 for _, s in outcomes if s), "from_nodes": fetched[:8]} if fetched else {}
            self._emit("checkpoint_snapshot_loaded", {"step": step, "durable_step": durable, **peers})
            self.mgr.restored_elsewhere(state)
            self._durable_too(step, durable)
            return Resumed(f"snapshot:step-{step}", step, reseed=False)
        self.snapshots.drop(step)
        reason = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        self._skip_snapshot(step, reason)
        if durable is None and not all(errors):
            # Some ranks hold the snapshot's state, the others a fresh one, and nothing durable overwrites both.
            raise SnapshotError(f"the in-memory snapshot of step {step} could not be restored ({reason}) and there "
                                f"is no durable checkpoint; it was dropped, a restart starts over")
        return None

    def _restore_resharded(self, candidate: Candidate, held: list[_Held]) -> Optional[Resumed]:
        """Restore a snapshot taken at another world size (snapshot_reshard.py), if newer than the durable tier:
        the old ranks' layouts gathered, then each rank plans, reads or copies its old slots, and loads; the ranks
        agree after each part, so a missing or corrupt slot leaves every state untouched."""
        durable = self.mgr.newest_step()
        step = candidate.step
        if durable is not None and durable > step:
            return None
        assert self.snapshots is not None
        started, root = time.monotonic(), self.snapshots.dir.parent
        lister = {}
        for r, h in enumerate(held):
            if h.slots:
                lister.setdefault(h.node, r)  # the rank that listed a node's slots reads their layouts
        shards, error = {}, None
        try:
            shards = {old: read_shards(root, holders[0]) for old, holders in enumerate(candidate.holders)
                      if lister[holders[0].node] == self.rank}
        except ValueError as e:
            error = str(e)
        gathered = self._all_gather((shards, error))
        if self._failed_on_some(step, [e for _, e in gathered]):
            return None
        state = self.state.checkpoint_state(self.rank, for_load=True)
        reshard: Optional[Reshard] = None
        try:
            need: set[int] = set()
            try:
                reshard = Reshard(candidate, {old: s for part, _ in gathered for old, s in part.items()}, state,
                                  root, held[self.rank].node,
                                  live={self.live.rank: self.live.slot} if self.live is not None else None)
                need = reshard.plan()
                error = None
            except (ValueError, KeyError) as e:
                error = f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)
            if self._failed_on_some(step, self._all_gather(error)):  # the move over the group needs every plan
                return None
            planned = time.monotonic()  # each part is timed to the gather after it: the slowest rank's time
            assert reshard is not None
            try:
                reshard.obtain(need, ([h.node for h in held], self.rank, self._all_gather))
                error = None
            except (ValueError, RuntimeError, KeyError, OSError) as e:
                error = f"{type(e).__name__}: {e}" if isinstance(e, (RuntimeError, KeyError)) else str(e)
            outcomes = self._all_gather((error, tuple(reshard.fetched_from), reshard.fetched_bytes, reshard.received,
                                         reshard.in_place_bytes, reshard.wrote_state, reshard.read_live))
            if self._failed_on_some(step, [e for e, *_ in outcomes]):
                if durable is None and any(o[5] for o in outcomes):  # every rank stops, not only the written
                    raise SnapshotError(f"the in-memory snapshot of step {step} could not be received at world size "
                                        f"{self.world_size} after part of it went into the state, and there is no "
                                        f"durable checkpoint; a restart starts over")
                return None
            obtained = time.monotonic()
            assert reshard is not None
            try:
                reshard.load()
                error = None
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's errors derive from BaseException
                error = str(e)
        finally:
            if reshard is not None:
                reshard.close()
        if self._failed_on_some(step, self._all_gather(error)):
            if durable is None:
                raise SnapshotError(f"the in-memory snapshot of step {step} could not be loaded at world size "
                                    f"{self.world_size} and there is no durable checkpoint; a restart starts over")
            return None
        fetched = [node for _, nodes, *_ in outcomes for node in nodes]
        fetched_bytes, received, in_place, live = (sum(o[i] for o in outcomes) for i in (2, 3, 4, 6))
        ended = time.monotonic()
        seconds = ended - started
        parts = {"plan_s": round(planned - started, 3), "obtain_s": round(obtained - planned, 3),
                 "load_s": round(ended - obtained, 3)}
        template_s = round(reshard.template_s, 3)  # of plan_s: the state's dicts built (allocation)
        log.info("resumed from the in-memory snapshot of step %d taken at world size %d (resharded to %d in %.2fs: "
                 "plan %.2fs (state dicts %.2fs), read/receive %.2fs, load %.2fs; %d slot(s) from peers, %d of them "
                 "over the process group, %d bytes, %d of them straight into place; %d old slot(s) read from the live "
                 "state; newest durable checkpoint: %s)", step, candidate.world_size, self.world_size, seconds,
                 parts["plan_s"], template_s, parts["obtain_s"], parts["load_s"],
                 len(fetched), received, fetched_bytes, in_place, live, durable)
        self._emit("checkpoint_snapshot_loaded", {
            "step": step, "durable_step": durable, "resharded_from": candidate.world_size, "seconds": seconds, **parts,
            "fetched_slots": len(fetched), "fetched_over_group": received, "fetched_bytes": fetched_bytes,
            "fetched_in_place_bytes": in_place, "live_slots": live, "template_s": template_s,
            "from_nodes": sorted(set(fetched))[:8]})
        self.mgr.restored_elsewhere(state)
        self._durable_too(step, durable)
        return Resumed(f"snapshot:step-{step}", step, reseed=True)

    def _durable_too(self, step: int, durable: Optional[int]) -> None:
        """A snapshot was loaded at the step of the newest durable checkpoint (it is written from that snapshot: the
        same state, read from memory instead of storage; measured at 50M, a grow in place paused 2.5 s instead of
        5.4-7.8 s): that step counts as saved, as after a durable load, so a stop right away does not save it again."""
        if durable == step:
            self._last_saved = self._resumed = step

    def _failed_on_some(self, step: int, errors: list[Optional[str]]) -> bool:
        """Whether any rank failed (then reported as the snapshot's skip, naming each failed rank)."""
        if not any(errors):
            return False
        self._skip_snapshot(step, "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))
        return True

    def _fetch(self, offer: Offer) -> SnapshotInfo:
        """Copy a peer's copy of this rank's snapshot into this rank's folder; its commit info there."""
        assert self.snapshots is not None
        fetch_offer(offer, self.snapshots.dir)
        copied = [i for i in self.snapshots.available()[0] if i.step == offer.step]
        if not copied:
            raise ValueError(f"the snapshot of step {offer.step} copied from {offer.peer.node} is not committed here")
        return copied[0]

    def _skip_snapshot(self, step: Optional[int], reason: str) -> None:
        what = f"the in-memory snapshot of step {step}" if step is not None else "an in-memory snapshot"
        log.warning("not resuming from %s: %s", what, reason)
        self._emit("checkpoint_snapshot_skipped", {"step": step, "reason": reason})

    def snapshot_if_due(self, final: bool) -> None:
        """Before the step's all_reduce: once a rank is past it, every rank holds this step's snapshot."""
        if self._pacer is None:
            return
        step, every = self.state.step, self.cfg.every_steps
        decided = self._pacer.pace
        # Called on every rank at every step, even with snapshots turned off here: its calibration is a collective.
        due = self._pacer.due(step, also=bool(every) and step % every == 0)
        if decided is None and self._pacer.pace is not None:
            self._paced(self._pacer.pace)
        if self.snapshots is not None and not final and due:
            self._snapshot(step)

    def _paced(self, pace: Pace) -> None:
        assert self._pacer is not None
        if self._pace_key:
            remember(self._pace_key, pace)
        carried = self._pacer.carried_over
        log.info("in-memory snapshots every %d step(s)%s: one costs %.3f s against a %.3f s step (%.1f%% at that "
                 "interval; target %.0f%%)", pace.interval, ", as the group before decided" if carried else "",
                 pace.cost_s, pace.step_s, 100 * pace.overhead, 100 * TARGET_COST)
        self._emit("checkpoint_snapshot_interval", {"interval": pace.interval, "cost_s": pace.cost_s,
                                                    "step_s": pace.step_s, "overhead": pace.overhead,
                                                    "carried": carried})

    def after_step(self, *, final: bool, stopping: bool, regrouping: bool = False, owed: bool = False) -> bool:
        """The durable save of this step, if due (or `owed`: one deferred at the boundary before). `regrouping`: the
        group re-forms in place at this boundary (a node joins): a save due now is not started, as the re-form would
        wait for its whole write (6.4 s at 50M on 2 cores), and True is returned: the caller owes it at the next
        step, whose snapshot it is then written from."""
        step = self.state.step
        if (final or stopping) and self.cfg.save_on_exit:
            if not self._holds(step):
                self._save(blocking=True)
        elif self.mgr.should_save(step) or owed:
            if regrouping:
                log.info("the durable save of step %d is deferred to the next step: the group re-forms now", step)
                return True
            self._save(blocking=False)
        return False

    def save_now(self) -> None:
        """An operator's "checkpoint now": a blocking save at this step (unless this step is already saved)."""
        if not self._holds(self.state.step):
            log.info("saving step %d on operator request", self.state.step)
            self._save(blocking=True)

    def _holds(self, step: int) -> bool:
        """Whether `step` is saved: resumed from, or committed (its async save in flight is waited for). A save
        that was skipped (the previous one still uploading) or failed does not count. A durable save waiting for
        its snapshot's copy is started first."""
        self._finish_snapshot()
        if self._last_saved != step:
            return False
        if self._resumed != step:
            self.mgr.wait()
            return self.mgr.last_committed == step
        return True

    def _save(self, blocking: bool) -> None:
        step = self.state.step
        agreed = False
        if not blocking and self.cfg.async_save:
            from_snapshot = self.mgr.saves_from_snapshots and self.snapshots is not None \
                and self._snapshot_step == step
            plan = self.mgr.plan_async(step, from_snapshot)
            if plan is None:
                return
            if plan:
                # Written from this step's snapshot once its copy (overlapping the next step) is committed.
                self._durable_pending = step
                if self.snapshots is not None and not self.snapshots.in_flight:
                    self._start_durable()
                return
            agreed = True
        # The agent allows the save phase more time than a step before it calls a worker hung.
        self.heartbeat.beat(step, "save")
        if self.mgr.save(step, self.state.checkpoint_state(self.rank), blocking=blocking, agreed=agreed):
            self._last_saved = step
        self.heartbeat.beat(step, "train")

    def _start_durable(self) -> None:
        """Start the pending durable save from its snapshot slot (on every rank: a collective)."""
        step, self._durable_pending = self._durable_pending, None
        assert step is not None
        store, view, release = self.snapshots, None, (lambda: None)
        info = store.last if store is not None else None
        if store is not None and info is not None and info.step == step:
            try:
                view, release = store.hold(info), partial(store.release, info)
            except (ValueError, OSError) as e:
                log.warning("the snapshot of step %d cannot be saved from: %s", step, e)
        if self.mgr.save_from_snapshot(step, view, release):
            self._last_saved = step

    def _snapshot(self, step: int) -> None:
        self._finish_snapshot()
        if self.snapshots is None:
            return
        try:
            state = self.state.checkpoint_state(self.rank, reuse=True)
            self.snapshots.save(step, state, later=self._optimizer_storages())
            self._snapshot_step = step
        except SnapshotRoomError as e:
            self._no_room(step, e)
            return
        except OSError as e:  # /dev/shm full (reserved before any write: never a SIGBUS), or gone
            self._snapshots_off(step, e)
            return
        if self._no_room_since is not None:
            log.info("in-memory snapshots taken again at step %d (no room from step %d)", step, self._no_room_since)
            self._emit("checkpoint_snapshot_resumed", {"step": step, "since": self._no_room_since})
            self._no_room_since = None

    def _no_room(self, step: int, e: SnapshotRoomError) -> None:
        """The node's snapshots do not fit now (after a resume or a re-form). Often for a while only: a survivor's
        slots of the smaller world shrink as they are rewritten at the new one. Retried at each snapshot due; the
        durable saves meanwhile come from the live state (this rank has no snapshot of their step)."""
        if self._no_room_since is None:
            self._no_room_since = step
            log.warning("no in-memory snapshot of step %d (retried at the next one): %s", step, e)
            self._emit("checkpoint_snapshot_failed", {"step": step, "error": str(e), "retrying": True})

    def _optimizer_storages(self) -> frozenset[int]:
        """The tensors only `optimizer.step()` changes in place: its parameters and its state."""
        optim = self.state.optim
        if optim is None:
            return frozenset()
        tensors = [p for group in optim.param_groups for p in group["params"]]
        tensors += [v for per_param in optim.state.values() for v in per_param.values() if isinstance(v, Tensor)]
        return frozenset(storage_key(t) for t in tensors)

    def _finish_snapshot(self) -> None:
        """Wait for the snapshot copy in flight, if any (before anything changes what it copies), then start the
        durable save waiting for it."""
        if self.snapshots is not None and self.snapshots.in_flight:
            try:
                self.snapshots.wait()
            except Exception as e:  # noqa: BLE001 - a failed snapshot must not fail the step
                self._snapshots_off(None, e)
        if self._durable_pending is not None:
            self._start_durable()

    def _snapshots_off(self, step: Optional[int], e: BaseException) -> None:
        what = f"the snapshot of step {step}" if step is not None else "a snapshot copy"
        log.warning("in-memory snapshots turned off: %s failed: %s", what, e)
        self._emit("checkpoint_snapshot_failed", {"step": step if step is not None else self.state.step,
                                                  "error": str(e)})
        self.snapshots = None
        self.mgr.saves_from_snapshots = False

    @property
    def saving(self) -> bool:
        """A durable save is in flight or waits for its snapshot's copy: a re-form now would wait for it."""
        return self._durable_pending is not None or self.mgr.save_in_flight

    def hand_over(self, live: bool = False) -> Optional[LiveSnapshot]:
        """The group re-forms in place at this step boundary (a node joins it): this step's snapshot taken (when
        snapshots are on here) and committed, the durable save in flight finished; then closed. The new group
        restores from that snapshot, so nothing is computed again.

        `live` (a grow, which builds a new model and leaves the old one's tensors as they are): when this step's
        copy is still in flight and no durable save waits for it, the copy is cancelled and the snapshot returned
        to be served from the live state (`SnapshotStore.live`): the re-form does not wait for the copy (0.2 s at
        50M parameters, 0.55 s at 150M on 2 cores), and the restore reads no slot and checks no checksum for it.
        Only with one worker on this node: another one could need this slot's file, which is then never written."""
        step = self.state.step
        if self.snapshots is not None and self._snapshot_step != step:
            self._snapshot(step)
        source = None
        if (live and self.snapshots is not None and self._snapshot_step == step and self._durable_pending is None
                and self._local_ranks == 1):
            source = self.snapshots.live(cancel=True)
        self._finish_snapshot()
        self.close()
        return source

    def abandon(self) -> None:
        """Drop this checkpointer after its process group failed (the in-place path, runtime/inplace.py): the
        snapshot copy in flight completes (node memory only; the recovery may load it), a durable save in flight is
        left to fail with its aborted group, so it is never committed; nothing waits on a collective."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._durable_pending = None
        if self.snapshots is not None:
            self.snapshots.close()
            self.snapshots = None

    def close(self) -> None:
        self.mgr.close()
        if self._hook is not None:
            self._hook.remove()
        if self.snapshots is not None:
            self.snapshots.close()
