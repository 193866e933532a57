"""CheckpointManager: when to save, async DCP save with atomic commit, retention, and resume.

Used from the training loop on every rank, at step boundaries:

    mgr = CheckpointManager(cfg.checkpoint, fingerprint=job.fingerprint(), rank=rank, world_size=world,
                            on_event=events.emit, extra_metadata={"hf_config": model.config.to_dict()})
    loaded = mgr.load_latest(state)            # None: start fresh; else loaded.step, loaded.missing_keys
    for step in ...:
        train_one_step()
        if mgr.should_save(step):              # same answer on every rank (collective when every_seconds)
            mgr.save(step, state)              # blocks while staging only; never raises a storage failure;
                                               # skipped while the previous save is still uploading
    mgr.close()                                # waits for the save in flight

`state` is a DCP state dict: values are tensors/DTensors, nested dicts, picklable objects, or
`Stateful` objects (their state_dict() is saved and load_state_dict() called on load). The lead's
training state: `model` (get_model_state_dict FQNs), `optim` (get_optimizer_state_dict), `scheduler`,
`trainer` (step, data cursor) and one `rng/rank{r}` per rank (see `compat` for other world sizes).

Process groups: when torch.distributed is initialized the manager creates two gloo groups of its own
(every rank must construct the manager, in the same order relative to other new_group calls): one for
DCP (async save on the default group hangs; a NCCL group cannot carry DCP's object collectives on
CPU), one for the manager's own small collectives, which must not interleave with a save running in
the background thread.

Failures: a failing save (storage down, bad credentials, disk full) is logged, reported as
`on_event("checkpoint_failed", {...})` and retried at the next interval; DCP turns any rank's failure
into an error on every rank, so all ranks count failures alike. After `max_consecutive_failures`
failures in a row (if > 0), the next `save()` (the same step on every rank) raises CheckpointError.
At start-up the storage is probed: a misconfiguration (credentials, missing bucket, not writable) raises
StorageError; an unreachable endpoint is retried for `storage_wait_s` (`checkpoint_storage_unreachable
{error}`), then raises; a full disk only logs and reports `checkpoint_storage_full {error}`.

Events (name, fields): checkpoint_saved {step, url, blocking_s, total_s, bytes}, checkpoint_failed {step, url,
error, consecutive}, checkpoint_loaded {step, url, saved_world_size, verify_s}, checkpoint_skipped {url, reason},
checkpoint_save_skipped {step, in_flight_step, in_flight_s | reason}, checkpoint_deleted {url}, checkpoint_storage_full
{error}, checkpoint_storage_unreachable {error}. saved, failed, save_skipped and loaded are reported on every rank
alike; the others on rank 0 only. `bytes`: the data DCP wrote, all ranks.

Staging: once `load_latest(state)` is done, the buffers of async saves are allocated for states shaped like
`state` and faulted in on a background thread: the first save after a (re)start blocks no longer than later ones.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future as CFuture
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from elastictrain.checkpoint import compat
from elastictrain.checkpoint.commit import CommittingWriter
from elastictrain.checkpoint.discovery import (
    CheckpointInfo,
    _group_by_step_dir,
    inspect_dir,
    open_checkpoint,
    verify_files,
)
from elastictrain.checkpoint.manifest import CheckpointMetadata, library_versions, parse_step_dir, step_dir_name
from elastictrain.checkpoint.reader import BlobReader
from elastictrain.checkpoint.retention import apply_retention
from elastictrain.checkpoint.staging import AS_IS as _AS_IS
from elastictrain.checkpoint.staging import ReusedCpuStager, plain_state_dict
from elastictrain.checkpoint.storage import Storage, check_storage, explain_storage_error, open_storage
from elastictrain.config import DEFAULT_STORAGE_WAIT_S, CheckpointConfig
from elastictrain.errors import (
    CheckpointError,
    CheckpointMismatchError,
    StorageError,
    StorageFullError,
    StorageUnreachableError,
)

log = logging.getLogger(__name__)

STORAGE_RETRY_S = 1.0
"""First delay between start-up probes of unreachable storage (doubling, at most 10 s)."""

EventSink = Callable[[str, dict[str, Any]], None]


@dataclass
class LoadedCheckpoint:
    step: int
    world_size: int
    """World size of the job that wrote the checkpoint."""
    url: str
    metadata: CheckpointMetadata
    missing_keys: list[str] = field(default_factory=list)
    """Per-rank keys of this rank that the checkpoint does not hold (other world size); re-derive them."""
    version_warnings: list[str] = field(default_factory=list)


@dataclass
class _InFlight:
    step: int
    url: str
    started: float
    blocking_s: float
    done: CFuture = field(default_factory=CFuture)
    """Set to None on success, or to the save's exception, after retention ran."""
    deleted: list[str] = field(default_factory=list)
    nbytes: int = 0
    release: Optional[Callable[[], None]] = None
    """Called once the upload is over, either way (a save from a snapshot slot frees the slot)."""


def _data_bytes(metadata: Metadata) -> int:
    """Bytes of data a DCP save wrote (every rank's items; .metadata and the manifest not counted)."""
    return sum(getattr(info, "length", 0) for info in (metadata.storage_data or {}).values())


def _short(exc: BaseException) -> str:
    """One line per failing rank of a DCP CheckpointException (no stack traces), else str(exc)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"rank {rank}: {type(inner).__name__}: {inner}")
        return "; ".join(parts)
    return f"{type(exc).__name__}: {exc}"


def _inner(exc: BaseException) -> BaseException:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return exc


class CheckpointManager:
    """Periodic sharded checkpoints of one job; one instance per rank (see the module docstring)."""

    def __init__(self, cfg: CheckpointConfig, *, fingerprint: dict[str, str], rank: int = 0, world_size: int = 1,
                 on_event: Optional[EventSink] = None, extra_metadata: Optional[dict[str, Any]] = None,
                 verify_on_load: bool = True) -> None:
        self.cfg = cfg
        self.fingerprint = dict(fingerprint)
        self.rank = rank
        self.world_size = world_size
        self.verify_on_load = verify_on_load
        self.extra_metadata = dict(extra_metadata or {})
        self._on_event = on_event
        self._distributed = dist.is_available() and dist.is_initialized()
        self._dcp_pg = dist.new_group(backend="gloo") if self._distributed else None
        self._ctl_pg = dist.new_group(backend="gloo") if self._distributed else None
        self._in_flight: Optional[_InFlight] = None
        self._stager = ReusedCpuStager(share_memory=cfg.async_mode == "process")
        self.saves_from_snapshots = False
        """Set when async saves are written from in-memory snapshots: no staging buffers are prepared."""
        self._staging_pending: Optional[dict[str, Any]] = None
        """A fresh start's state, whose staging buffers are readied after the first step (see `_prepare_staging`)."""
        self._failures = 0
        self._last_saved_step: Optional[int] = None
        self.last_committed: Optional[int] = None
        """The step of the newest save this manager committed (an async one once `wait` recorded it)."""
        self._last_save_time = time.monotonic()
        self.last_error: Optional[str] = None
        self.storage: Optional[Storage] = open_storage(cfg.url, cfg.storage_options) if cfg.url else None
        if self.storage is not None:
            self._check_storage()

    # ------------------------------------------------------------------ helpers

    def _emit(self, name: str, **fields: Any) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(name, fields)
        except Exception:  # an event sink must not take training down
            log.exception("event sink failed on %s", name)

    def _broadcast(self, obj: Any) -> Any:
        """Rank 0's value of `obj` on every rank (manager's control group)."""
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._ctl_pg, 0), group=self._ctl_pg)
        return box[0]

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self._ctl_pg)
        dist.all_gather_object(out, obj, group=self._ctl_pg)
        return out

    def agree_max(self, value: int) -> int:
        """The largest `value` over the ranks (a collective on the control group; `value` itself when alone)."""
        if not self._distributed:
            return value
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self._ctl_pg)
        return int(box.item())

    def _check_storage(self) -> None:
        """Fail fast on misconfigured storage; a full one is reported and training goes on.

        A full disk is a condition that passes (retention, an operator freeing space), and it may coincide
        with a restart: refusing to start would turn it into failed restarts, a spent budget and, since
        no step is made, a crash loop that ends the job. Saves fail as events until there is space again,
        as they do when storage fills up during a run. Reads (the resume) still work.
        """
        assert self.storage is not None
        error: Optional[tuple[bool, str]] = None
        if self.rank == 0:
            try:
                self._probe_until_reachable()
            except StorageError as e:
                error = (isinstance(e, StorageFullError), str(e))
        error = self._broadcast(error)
        if error is None:
            return
        full, message = error
        if not full:
            raise StorageError(message)
        self.last_error = message
        if self.rank == 0:
            log.error("%s; training goes on and saves fail until space is freed", message)
            self._emit("checkpoint_storage_full", error=message)

    def _probe_until_reachable(self) -> None:
        """check_storage, retried while the endpoint is unreachable, for up to cfg.storage_wait_s.

        An object store that is down when workers (re)start would otherwise fail every restart: the
        budget is spent and, with no step made, the job ends as a crash loop. The resume needs the
        storage anyway, so waiting is the only way forward; misconfigurations fail at once.
        """
        assert self.storage is not None
        wait = DEFAULT_STORAGE_WAIT_S if self.cfg.storage_wait_s is None else self.cfg.storage_wait_s
        deadline = time.monotonic() + wait
        delay, next_log = STORAGE_RETRY_S, 0.0
        while True:
            try:
                check_storage(self.storage)
                if next_log:
                    log.info("checkpoint storage %s is reachable again", self.storage.url)
                return
            except StorageUnreachableError as e:
                now = time.monotonic()
                if now + delay > deadline:
                    raise StorageUnreachableError(f"{e} (waited {wait:g} s, "
                                                  f"checkpoint.storage_wait_s)") from None
                if now >= next_log:
                    log.warning("%s; retrying for up to %.0f s more", e, deadline - now)
                    self._emit("checkpoint_storage_unreachable", error=str(e))
                    next_log = now + 30.0
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    # ------------------------------------------------------------------ saving

    def should_save(self, step: int) -> bool:
        """Whether to save after `step`; the same answer on every rank."""
        if self._staging_pending is not None:
            state, self._staging_pending = self._staging_pending, None
            self._prepare_staging(state)
        if self._in_flight is not None and self._in_flight.done.done():
            self.wait()  # records the outcome (events) without blocking
        if self.storage is None or step == self._last_saved_step:
            return False
        due = self.cfg.every_steps > 0 and step > 0 and step % self.cfg.every_steps == 0
        if self.cfg.every_seconds > 0 and not due:
            # Clocks differ between ranks; rank 0's decides, or DCP's collectives would deadlock.
            flag = torch.tensor([time.monotonic() - self._last_save_time >= self.cfg.every_seconds], dtype=torch.uint8)
            if self._distributed:
                dist.broadcast(flag, src=dist.get_global_rank(self._ctl_pg, 0), group=self._ctl_pg)
            due = bool(flag.item())
        return due

    def save(self, step: int, state: dict[str, Any], *, blocking: bool = False, agreed: bool = False) -> bool:
        """Save `state` as the checkpoint of `step` on every rank; False if it failed (blocking) or was skipped.

        Async (cfg.async_save and not blocking): skipped, on every rank, while the previous save is still
        in flight on any rank (`checkpoint_save_skipped`; `agreed`: `plan_async` already checked); else returns once
        the state is staged, and the upload and commit finish in the background. Blocking: waits for the save in
        flight first. Storage failures never raise; CheckpointError only after cfg.max_consecutive_failures failed
        saves in a row.
        """
        if self.storage is None:
            raise CheckpointError("save() without checkpoint.url; set checkpoint.url to enable checkpoints")
        if self.cfg.async_save and not blocking and not agreed and self._agree(step, unable=False)[0]:
            return False
        writer, url, t0 = self._begin(step)
        if blocking or not self.cfg.async_save:
            try:
                saved = dcp.save(state, storage_writer=writer, process_group=self._dcp_pg,
                                 no_dist=not self._distributed)
            except (Exception, CheckpointException) as e:
                self._record_failure(step, url, e)
                return False
            elapsed = time.monotonic() - t0
            self._record_success(step, url, elapsed, elapsed, _data_bytes(saved))
            for deleted in self._retain():
                self._emit("checkpoint_deleted", url=deleted)
            return True
        kind = AsyncCheckpointerType.PROCESS if self.cfg.async_mode == "process" else AsyncCheckpointerType.THREAD
        self._start_async(step, state, (writer, url, t0), self._stager, kind)
        return True

    def _begin(self, step: int) -> tuple[CommittingWriter, str, float]:
        """Before any save of `step`: the save in flight recorded, the failure limit checked; the writer, the URL
        and the start time."""
        assert self.storage is not None
        self.wait()
        self._raise_if_failing()
        dirname = step_dir_name(step)
        metadata = CheckpointMetadata(step=step, world_size=self.world_size, fingerprint=self.fingerprint,
                                      versions=library_versions(), extra=self.extra_metadata)
        self._last_saved_step = step
        self._last_save_time = time.monotonic()
        writer = CommittingWriter(self.storage, dirname, metadata, dedup=self.cfg.dedup,
                                  compression=self.cfg.compression, dedup_min_bytes=self.cfg.dedup_min_bytes)
        return writer, self.storage.url_for(dirname), time.monotonic()

    def _start_async(self, step: int, state: dict[str, Any], begun: tuple[CommittingWriter, str, float],
                     stager: AsyncStager, kind: AsyncCheckpointerType,
                     release: Optional[Callable[[], None]] = None) -> None:
        writer, url, t0 = begun
        # Staging errors are local to this rank (its state_dict() failed): the other ranks are already in
        # the save's collectives, so this is not a recoverable storage failure; let it raise.
        try:
            fut = dcp.async_save(state, storage_writer=writer, process_group=self._dcp_pg, async_stager=stager,
                                 async_checkpointer_type=kind, no_dist=not self._distributed)
        except BaseException:
            if release is not None:
                release()
            raise
        upload = getattr(fut, "upload_completion", fut)
        flight = _InFlight(step=step, url=url, started=t0, blocking_s=time.monotonic() - t0, release=release)
        self._in_flight = flight
        upload.add_done_callback(lambda f: self._after_upload(flight, f))

    def plan_async(self, step: int, from_snapshot: bool) -> Optional[bool]:
        """The ranks' common plan for the async save of `step` that is due (a collective): None, skipped on every
        rank (the previous save is still uploading); True, written from every rank's snapshot of `step`
        (`save_from_snapshot`, once it is committed); False, from the live state (`save`: some rank has no
        snapshot to write from)."""
        skip, unable = self._agree(step, unable=not from_snapshot)
        return None if skip else not unable

    def save_from_snapshot(self, step: int, state: Optional[dict[str, Any]], release: Callable[[], None]) -> bool:
        """Write the durable checkpoint of `step` from this rank's committed snapshot (`state`: views of its slot,
        None when this rank's snapshot failed); after `plan_async` said so, on every rank. Returns at once: the
        upload runs in the background and calls `release` when it is over (or before returning, when it was not
        started: every rank skips it when any rank has no snapshot)."""
        assert self.storage is not None
        if self._agree(step, unable=state is None, check_flight=False)[1]:
            release()
            log.warning("checkpoint step %d skipped: the in-memory snapshot it is written from failed on a rank",
                        step)
            self._emit("checkpoint_save_skipped", step=step, reason="snapshot failed")
            return False
        assert state is not None
        try:
            begun = self._begin(step)
        except BaseException:
            release()
            raise
        self._start_async(step, state, begun, _AS_IS, AsyncCheckpointerType.THREAD, release)
        return True

    def _agree(self, step: int, unable: bool, check_flight: bool = True) -> tuple[bool, bool]:
        """(skip, any rank unable) for the async save of `step`, the same on every rank (one small all_reduce on
        the control group: DCP's collectives need every rank to save alike).

        Skip when any rank's previous save is still uploading: waiting for it would stall training on the
        storage (a stalled or slow object store would cost every rank its steps for as long as the upload
        takes, and a slow save is not worth that).
        """
        flight = self._in_flight if check_flight else None
        busy = flight is not None and not flight.done.done()
        mine = torch.tensor([flight.step if busy else -1, time.monotonic() - flight.started if busy else 0.0,
                             float(unable)], dtype=torch.float64)
        if self._distributed:
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self._ctl_pg)
        in_flight_step, running_s, any_unable = int(mine[0].item()), float(mine[1].item()), bool(mine[2].item())
        if in_flight_step < 0:
            return False, any_unable
        self._last_save_time = time.monotonic()  # every_seconds: the next one an interval from now
        if self.rank == 0:
            log.warning("checkpoint step %d skipped: the save of step %d is still in flight (%.1f s); training "
                        "does not wait for storage. If this repeats, save less often (checkpoint.every_steps / "
                        "every_seconds)", step, in_flight_step, running_s)
        self._emit("checkpoint_save_skipped", step=step, in_flight_step=in_flight_step, in_flight_s=running_s)
        return True, any_unable

    def _after_upload(self, flight: _InFlight, fut: Any) -> None:
        # Runs in DCP's executor thread: retention here keeps it off the training thread, and inside the
        # "save in flight" window so that the next save cannot start while it deletes.
        exc = fut.exception()
        if flight.release is not None:
            flight.release()
        if exc is None:
            flight.nbytes = _data_bytes(fut.result())
            flight.deleted = self._retain()
        flight.done.set_result(exc)

    def _retain(self) -> list[str]:
        if self.rank != 0 or self.storage is None:
            return []
        try:
            return apply_retention(self.storage, self.cfg.keep_last, self.cfg.keep_every)
        except Exception as e:  # retention failing must not fail the save that triggered it
            log.warning("retention under %s failed: %s", self.storage.url, e)
            return []

    def _record_success(self, step: int, url: str, blocking_s: float, total_s: float, nbytes: int) -> None:
        self._failures = 0
        self.last_committed = step
        log.info("checkpoint step %d saved to %s (blocked %.3fs, total %.3fs, %.1f MB)", step, url, blocking_s,
                 total_s, nbytes / 1e6)
        self._emit("checkpoint_saved", step=step, url=url, blocking_s=blocking_s, total_s=total_s, bytes=nbytes)

    def _record_failure(self, step: int, url: str, exc: BaseException) -> None:
        self._failures += 1
        assert self.storage is not None
        reason = str(explain_storage_error(_inner(exc), self.storage, "save to"))
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and len(failures) > 1:
            reason += f" (failed on ranks {', '.join(str(r) for r in sorted(failures))})"
        log.error("checkpoint step %d to %s failed (%d in a row): %s", step, url, self._failures, reason)
        self._emit("checkpoint_failed", step=step, url=url, error=reason, consecutive=self._failures)
        self.last_error = reason

    def _raise_if_failing(self) -> None:
        limit = self.cfg.max_consecutive_failures
        if limit > 0 and self._failures >= limit:
            raise CheckpointError(
                f"{self._failures} checkpoint saves in a row failed (checkpoint.max_consecutive_failures={limit}); "
                f"last error: {self.last_error}. Fix the storage and resume from the last valid "
                f"checkpoint, or raise the limit (0 keeps training without checkpoints)")

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    @property
    def save_in_flight(self) -> bool:
        return self._in_flight is not None and not self._in_flight.done.done()

    def wait(self) -> None:
        """Wait for the save in flight (if any) and record its outcome."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        exc = flight.done.result()
        if exc is None:
            self._record_success(flight.step, flight.url, flight.blocking_s, time.monotonic() - flight.started,
                                 flight.nbytes)
            for deleted in flight.deleted:
                self._emit("checkpoint_deleted", url=deleted)
        else:
            self._record_failure(flight.step, flight.url, exc)

    def _prepare_staging(self, state: dict[str, Any]) -> None:
        """Staging buffers ready before the first async save, which otherwise allocated them while training waited.

        Called once the resume is done: faulting the pages in then overlaps the first steps, not the resume.
        """
        if self.storage is None or not self.cfg.async_save or self.saves_from_snapshots:
            return
        self._stager.prepare(plain_state_dict(state))

    def close(self) -> None:
        """Wait for the save in flight and free the staging buffers; the process groups stay (destroyed with
        the default one)."""
        self.wait()
        self._stager.close()

    # ------------------------------------------------------------------ loading

    def _candidates(self) -> Any:
        """Rank 0 only: structurally valid checkpoints, newest first (one listing, lazy marker reads)."""
        assert self.storage is not None
        groups = _group_by_step_dir(self.storage.list_files())
        for d in sorted(groups, key=lambda n: parse_step_dir(n) or -1, reverse=True):
            info = inspect_dir(self.storage, d, groups[d])
            if info.valid:
                yield info
            else:
                log.warning("skipping checkpoint %s: %s", info.url, info.reason)
                self._emit("checkpoint_skipped", url=info.url, reason=info.reason)

    def _rank0(self, fn: Callable[[], Any], storage: Optional[Storage]) -> Any:
        """fn() on rank 0, its result (or its error, re-raised) on every rank: no rank waits for a dead one."""
        outcome: Any = None
        if self.rank == 0:
            try:
                outcome = ("ok", fn())
            except CheckpointError as e:
                outcome = ("err", type(e), str(e))
            except Exception as e:  # storage errors come in many types (OSError, botocore, aiohttp)
                err = explain_storage_error(e, storage, "read") if storage is not None else CheckpointError(str(e))
                outcome = ("err", type(err), str(err))
        outcome = self._broadcast(outcome)
        if outcome[0] == "err":
            raise outcome[1](outcome[2])
        return outcome[1]

    def _verified(self, info: CheckpointInfo, storage: Storage) -> list[str]:
        """Checksums of `info`'s files, each rank reading its share; the problems found by any rank.

        A read that fails (storage down) raises StorageError on every rank rather than counting as
        corruption: falling back to an older checkpoint, or to a fresh start, because S3 blinked would
        silently throw training away.
        """
        if not self.verify_on_load or info.manifest is None:
            return []
        names = [f.name for f in info.manifest.files] + [b.name for b in info.manifest.blobs]
        world = dist.get_world_size(self._ctl_pg) if self._distributed else 1
        me = dist.get_rank(self._ctl_pg) if self._distributed else 0
        try:
            mine: tuple[list[str], Optional[str]] = (verify_files(storage, info, names[me::world]), None)
        except Exception as e:
            mine = ([], str(explain_storage_error(e, storage, "read")))
        gathered = self._all_gather(mine)
        errors = [err for _, err in gathered if err]
        if errors:
            raise StorageError(errors[0])
        return [p for problems, _ in gathered for p in problems]

    def _choose(self) -> Optional[tuple[CheckpointInfo, Storage]]:
        """The checkpoint to resume from under cfg.resume, agreed on by every rank, or None."""
        resume = self.cfg.resume
        if resume == "never" or (resume == "auto" and self.storage is None):
            return None
        if resume != "auto":
            st = open_storage(resume, self.cfg.storage_options)
            parent = Storage(url=st.url.rstrip("/").rsplit("/", 1)[0], fs=st.fs, root=st.root.rsplit("/", 1)[0],
                             protocol=st.protocol, options=st.options)
            info = self._rank0(lambda: open_checkpoint(st), st)
            compat.check_format(info)
            if not info.valid:
                raise CheckpointError(f"checkpoint.resume={resume}: not a valid checkpoint ({info.reason}); "
                                      f"point it at a committed step-* directory or use 'auto'")
            problems = self._verified(info, parent)
            if problems:
                raise CheckpointError(f"checkpoint.resume={resume} is corrupt: {'; '.join(problems)}")
            return info, parent
        storage = self.storage
        assert storage is not None
        gen = self._candidates() if self.rank == 0 else None  # lazy: lists on the first next()
        while True:
            info = self._rank0(lambda: next(gen, None), storage)  # type: ignore[arg-type]
            if info is None:
                return None
            compat.check_format(info)
            problems = self._verified(info, storage)
            if not problems:
                return info, storage
            reason = "; ".join(problems)
            if self.rank == 0:
                log.warning("skipping checkpoint %s: %s", info.url, reason)
                self._emit("checkpoint_skipped", url=info.url, reason=reason)

    def newest_step(self) -> Optional[int]:
        """Step of the newest committed checkpoint `load_latest` would consider (not verified); agreed by all ranks."""
        if self.storage is None or self.cfg.resume != "auto":
            return None
        info = self._rank0(lambda: next(self._candidates(), None), self.storage)
        return info.manifest.metadata.step if info is not None and info.manifest is not None else None

    def restored_elsewhere(self, state: dict[str, Any]) -> None:
        """The state was restored from another tier (a snapshot): get the async-save buffers ready now."""
        self._prepare_staging(state)

    def load_latest(self, state: dict[str, Any]) -> Optional[LoadedCheckpoint]:
        """Load the checkpoint chosen by cfg.resume into `state` (in place); None when starting fresh.

        Raises CheckpointMismatchError (naming fingerprint parts and keys) when it does not fit this job,
        StorageError when storage cannot be read, CheckpointError for an unusable `resume` URL.
        """
        self.wait()
        t0 = time.monotonic()
        chosen = self._choose()
        if chosen is None:
            log.info("no checkpoint to resume from (resume=%s); starting fresh", self.cfg.resume)
            # Not yet: an optimizer's state_dict() before its first step initialises its state with a zero-lr
            # step (torch's _init_optim_state), which would count one step too many (AdamW's bias correction).
            self._staging_pending = state
            return None
        info, storage = chosen
        verify_s = time.monotonic() - t0
        assert info.manifest is not None
        md = info.manifest.metadata
        reader = BlobReader(info.url, **storage.options)
        try:
            dcp_metadata = reader.read_metadata()
        except Exception as e:
            raise explain_storage_error(e, storage, "read") from None
        fp_diffs = compat.fingerprint_diffs(self.fingerprint, md.fingerprint)
        absent, problems = compat.key_problems(state, dcp_metadata)
        compat.raise_mismatch(info.url, fp_diffs, problems)
        version_warnings = compat.warn_versions(library_versions(), md.versions, info.url)
        to_load = {k: v for k, v in state.items() if k not in absent}
        try:
            dcp.load(to_load, storage_reader=reader, process_group=self._dcp_pg, no_dist=not self._distributed)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"loading checkpoint {info.url} failed: {_short(e)}") from None
        self._last_saved_step = md.step
        self._last_save_time = time.monotonic()
        log.info("resumed from %s (step %d, written at world size %d)", info.url, md.step, md.world_size)
        self._emit("checkpoint_loaded", step=md.step, url=info.url, saved_world_size=md.world_size,
                   verify_s=verify_s)
        self._prepare_staging(state)
        return LoadedCheckpoint(step=md.step, world_size=md.world_size, url=info.url, metadata=md,
                                missing_keys=absent, version_warnings=version_warnings)


__all__ = ["CheckpointManager", "LoadedCheckpoint", "CheckpointMismatchError"]
