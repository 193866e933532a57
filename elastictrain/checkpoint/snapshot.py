"""In-memory snapshots of a rank's train state that outlive the worker process (the T0 tier).

Each rank copies its shard of the full train state (the same content as a durable checkpoint: model and optimizer
shards, scheduler, data cursor, RNG, step) into files on a node-owned RAM file system (`/dev/shm`, a directory the
agent creates for the run and removes when the job ends). A restarted worker on the same node finds them there
and resumes from the step before the crash, without a storage read and without recomputing steps.

Layout, per rank: two slots (a third while a durable save reads one, below), each `rank<r>/slot<k>.bin` (the
tensors' bytes, back to back), `slot<k>.meta` (pickled layout: per tensor its key path, dtype, shape and offset, and
for a DTensor the global shape and this shard's global offset; the non-tensor values) and `slot<k>.json`, the slot's
commit marker (step, identity, size, checksum of the bytes). A save takes the older slot, removes its marker first,
writes the bytes and the layout, then renames the new marker into place: a crash in the middle of a copy leaves the
other slot's snapshot committed, never a torn one. Two slots also let ranks that died one step apart agree on a step
they all hold. A load checks the identity (run, fingerprint, world size, checkpoint URL) and the checksum; anything
that does not match is not used, with the reason returned to the caller.

A durable checkpoint can be written from a committed slot instead of from the live state (`hold` gives a DCP state
dict whose tensors are views of the slot): training then pays nothing for a durable save beyond the snapshot it
takes anyway. The held slot is not rewritten until `release`; meanwhile snapshots rotate over the two others, so a
crash during the upload still finds the snapshot of the step before it.

Restoring fills the live state in place: each tensor of a freshly taken state dict (a DTensor's local shard)
receives the saved bytes, each other value is replaced, then every `Stateful` gets `load_state_dict`. It needs the
same world size and sharding as the save (the rank's own shard). A snapshot of the same job at another world size
is not "another job": checkpoint/snapshot_reshard.py loads the old ranks' slots together through DCP instead.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import pickle
import shutil
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from elastictrain.checkpoint.snapshot_folders import SLOTS

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23
"""Linux >= 5.14: map every page of a range writable now, in one call, without touching its bytes."""

ENV_SNAPSHOT_DIR = "ELASTICTRAIN_SNAPSHOT_DIR"
"""Set by the agent for its workers: the node's directory for this run's snapshots (removed at job end)."""


@dataclass(frozen=True)
class SnapshotInfo:
    """What a slot's commit marker says about the snapshot in it."""

    step: int
    slot: int
    nbytes: int
    checksum: int
    """The bytes as 64-bit words, summed modulo 2**64 (any single flipped bit changes it; 4x faster than CRC-32,
    which cost half of a snapshot's time)."""
    identity: dict[str, Any]


def _leaves(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, value) of every leaf of nested dicts/lists/tuples; an empty dict or list is a leaf too (a restore
    rebuilds the structure from the leaves, and would lose it otherwise)."""
    if isinstance(obj, dict) and (obj or not path):
        for k in obj:
            yield from _leaves(obj[k], (*path, k))
    elif isinstance(obj, list) and (obj or not path):  # a tuple is a leaf (immutable: replaced whole on restore)
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    else:
        yield path, obj


def _rebuild(obj: Any, path: tuple, leaves: dict[tuple, Any]) -> Any:
    """`obj`'s structure (as `_leaves` walks it) with each leaf taken from `leaves` by its path."""
    if isinstance(obj, dict) and (obj or not path):
        return {k: _rebuild(v, (*path, k), leaves) for k, v in obj.items()}
    if isinstance(obj, list) and (obj or not path):
        return [_rebuild(v, (*path, i), leaves) for i, v in enumerate(obj)]
    return leaves[path]


def _set(obj: Any, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _materialise(state: dict[str, Any]) -> dict[str, Any]:
    """Every top-level value as plain data: a `Stateful`'s `state_dict()`, others as they are."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}


def same_job(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two snapshot identities name the same job; the world size may differ (a re-form at another size)."""
    return {k: v for k, v in a.items() if k != "world_size"} == {k: v for k, v in b.items() if k != "world_size"}


def _checksum(buf: torch.Tensor) -> int:
    whole = buf.numel() // 8 * 8
    words = int(buf[:whole].view(torch.int64).sum()) if whole else 0  # torch's integer sum wraps around
    return (words + int(buf[whole:].sum())) % (1 << 64)


def _map_slot(path: Path, nbytes: int, grow_only: bool = False) -> torch.Tensor:
    """A slot's file, sized to `nbytes` and reserved, mapped as uint8 (shared: writes land in the file).
    `grow_only`: a file already larger keeps its size (and the committed snapshot it may hold)."""
    size = max(nbytes, 1)
    with open(path, "ab") as f:
        if not grow_only or os.fstat(f.fileno()).st_size < size:
            f.truncate(size)
        # Reserve the pages now: a write through the mapping into a full tmpfs is a SIGBUS, not an error.
        os.posix_fallocate(f.fileno(), 0, size)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def _populate(buf: torch.Tensor) -> bool:
    """Map every page of a slot's mapping now, so that the copies into it later do not fault page by page (on this
    kind of VM ~0.3 s per GB, on whichever thread copies first); False where the kernel cannot (the copies fault as
    before). The bytes are not touched."""
    if not sys.platform.startswith("linux") or buf.numel() == 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(buf.numel()), _MADV_POPULATE_WRITE) == 0
    except (OSError, AttributeError):
        return False


class SnapshotStore:
    """One rank's snapshots under `<root>/rank<r>`: `save(step, state)`, `available()`, `restore(info, state)`."""

    def __init__(self, root: str | Path, rank: int, identity: dict[str, Any],
                 check_room: Optional[Callable[[int], None]] = None):
        """`check_room(bytes)`: called before the slots are first reserved, and when the state grew (it raises
        when the node cannot hold them: `snapshot_budget.room_check`)."""
        self.dir, self.rank = Path(root) / f"rank{rank}", rank
        self._check_room, self._room_checked = check_room, 0
        self.identity = json.loads(json.dumps(identity, sort_keys=True, default=str))
        self._buffers: dict[int, torch.Tensor] = {}
        self._chunks: dict[tuple, tuple] = {}
        self._pending: Optional[_Copy] = None
        self._templates: dict[int, dict[str, Any]] = {}
        """Per slot, the state as it was saved (its tensors say how a durable save shards them: `hold`)."""
        self._held: set[int] = set()
        self._rotate_three = False
        self._lock = threading.Lock()
        self._preparing: dict[int, threading.Thread] = {}
        """Slots being sized and mapped on a thread of their own (`_prepare_others`); a save of one waits for it."""
        self._sized: set[int] = set()
        """Slots a save of this store has written: their files are this state's size."""
        self.last: Optional[SnapshotInfo] = None
        """The newest snapshot this store committed."""

    # --- saving ------------------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], later: frozenset[int] = frozenset()) -> Optional[SnapshotInfo]:
        """Copy `state` (DCP-style: Stateful or plain values) into the older slot, then commit that slot.

        Tensors whose storage (`storage_key`) is in `later` are copied on a copy thread while the caller goes on;
        the slot is committed when the thread is done (`wait()`). The caller promises not to change them in place
        before `wait()` returns (the step loop passes the optimizer's parameters and state, and waits in an
        optimizer-step pre-hook). Everything else (buffers a forward pass may change, RNG, Python values) is copied
        before `save` returns. The previous save is waited for first. Returns the commit info when nothing was
        deferred.
        """
        self.wait()
        slot = self._next_slot()
        flat = _materialise(state)
        copies: list[tuple[torch.Tensor, int, int, bool]] = []  # (tensor, offset, bytes, deferred)
        objects, layout, chunks, offset = [], [], [], 0
        for path, value in _leaves(flat):
            if isinstance(value, torch.Tensor):
                local = _local(value).detach()
                n = local.numel() * local.element_size()
                layout.append((path, str(local.dtype).removeprefix("torch."), tuple(local.shape), offset, n))
                chunks.append(self._chunk(value) if isinstance(value, DTensor) else None)
                if n:
                    copies.append((local, offset, n, storage_key(local) in later))
                offset += n
            else:
                objects.append((path, value))
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._check_room is not None and offset > self._room_checked:
            self._check_room(offset)
            self._room_checked = offset
        (self.dir / f"slot{slot}.json").unlink(missing_ok=True)  # uncommitted from here on
        buf = self._buffer(slot, offset)
        _copy_into(buf, [c for c in copies if not c[3]])
        with open(self.dir / f"slot{slot}.meta", "wb") as f:
            pickle.dump({"layout": layout, "objects": objects, "keys": sorted(flat), "chunks": chunks}, f,
                        protocol=pickle.HIGHEST_PROTOCOL)
        self._templates[slot] = flat
        deferred = [c for c in copies if c[3]]
        if not deferred:
            return self._commit(step, slot, buf, offset)
        ready = None
        if any(t.is_cuda for t, *_ in deferred):
            ready = torch.cuda.Event()
            ready.record()  # the copy stream starts after the work queued so far (the optimizer step)
        self._pending = _Copy(self, step, slot, buf, offset, deferred, ready)
        return None

    def prepare(self, state: dict[str, Any]) -> None:
        """Size, reserve and map the slots in rotation for a state like `state` on threads while training goes on
        (after a restore, so that the first saves of a re-formed group copy at full speed; `_buffer`). Nothing when
        the node's budget refuses the size now (the save that needs them says so) or the state holds no tensor yet.
        The snapshots the slots hold stay committed until saves rewrite them."""
        nbytes = 0
        for _, value in _leaves(_materialise(state)):
            if isinstance(value, torch.Tensor):
                local = _local(value)
                nbytes += local.numel() * local.element_size()
        if not nbytes:
            return
        if self._check_room is not None and nbytes > self._room_checked:
            try:
                self._check_room(nbytes)
            except Exception as e:  # noqa: BLE001 - the save meets it again and reports it
                log.debug("snapshot slots not prepared: %s", e)
                return
            self._room_checked = nbytes
        self.dir.mkdir(parents=True, exist_ok=True)
        self._prepare_others(None, nbytes)

    def _next_slot(self) -> int:
        """The slot to write: the one with no or the oldest commit among the two in rotation, or, once a durable
        save has held one, among the three that are not held."""
        steps = {i.slot: i.step for i in self._committed()}
        with self._lock:
            free = [k for k in SLOTS if k not in self._held] if self._rotate_three else [0, 1]
        return min(free, key=lambda k: steps.get(k, -1))

    def hold(self, info: SnapshotInfo) -> dict[str, Any]:
        """The committed snapshot `info` (this store's own newest) as a DCP state dict to save from: its tensors are
        views of the slot (a DTensor keeps the live one's mesh and placements), its other values as saved. The slot
        is not rewritten until `release(info)`."""
        template = self._templates.get(info.slot)
        if template is None or self.last is None or self.last.slot != info.slot or self.last.step != info.step:
            raise ValueError(f"the snapshot of step {info.step} is not this store's newest")
        meta = read_layout(self.dir, info)
        buf = self._buffers[info.slot]
        values: dict[tuple, Any] = dict(meta["objects"])
        live = dict(_leaves(template))
        for path, dtype, shape, off, n in meta["layout"]:
            view = buf[off:off + n].view(getattr(torch, dtype)).reshape(shape)
            like = live[path]
            values[path] = (DTensor.from_local(view, like.device_mesh, like.placements, run_check=False,
                                               shape=like.shape, stride=like.stride())
                            if isinstance(like, DTensor) else view)
        with self._lock:
            self._held.add(info.slot)
            self._rotate_three = True
        return _rebuild(template, (), values)

    def release(self, info: SnapshotInfo) -> None:
        """The durable save from `info`'s slot is done (any thread): the slot rotates again."""
        with self._lock:
            self._held.discard(info.slot)

    def _chunk(self, value: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(global shape, this shard's global offset) of a DTensor, as DCP's planner sees it (what a restore at
        another world size reshards from). Computed once per sharding spec, which torch shares between the state
        dicts it builds: DTensor's helper takes ~0.1 ms a tensor, its public properties ~3 us, every step."""
        spec = value._spec
        hit = self._chunks.get(id(spec))
        if hit is None or hit[0] is not spec:
            if len(self._chunks) > 1 << 16:  # specs that were not shared after all: start over, do not grow
                self._chunks.clear()
            chunk = value.__create_chunk_list__()[0]
            hit = self._chunks[id(spec)] = (spec, tuple(value.shape), tuple(chunk.offsets))
        return hit[1], hit[2]

    def wait(self) -> Optional[SnapshotInfo]:
        """Finish the save in flight, if any: its commit info, or the error that stopped it (raised once). A copy
        cancelled by `live(cancel=True)` stops at its next tensor and returns None: nothing committed, no error."""
        pending, self._pending = self._pending, None
        return pending.join() if pending is not None else None

    def live(self, cancel: bool = False) -> Optional["LiveSnapshot"]:
        """The save in flight, read where its bytes are now (`LiveSlot`): the deferred tensors from the live state,
        the rest from the slot, where `save` copied it before it returned. None when nothing is in flight or its
        tensors are on a device. The caller promises what `save` asked for, for as long as it reads: the deferred
        tensors are not changed in place (a grow in place drops the old model and builds a new one: they stay as
        they were). `cancel`: the copy stops at its next tensor, the slot stays uncommitted (no one else reads it)."""
        pending = self._pending
        if pending is None or any(t.device.type != "cpu" for t, *_ in pending.copies):
            return None
        info = SnapshotInfo(step=pending.step, slot=pending.slot, nbytes=pending.nbytes, checksum=0,
                            identity=self.identity)
        out = LiveSnapshot(self.rank, info, LiveSlot(pending.buf, pending.nbytes, pending.copies))
        if cancel:
            pending.cancel.set()
        return out

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def _commit(self, step: int, slot: int, buf: torch.Tensor, nbytes: int) -> SnapshotInfo:
        info = SnapshotInfo(step=step, slot=slot, nbytes=nbytes, checksum=_checksum(buf[:nbytes]),
                            identity=self.identity)
        tmp = self.dir / f"slot{slot}.json.tmp"
        tmp.write_text(json.dumps(asdict(info)))
        os.replace(tmp, self.dir / f"slot{slot}.json")
        self.last = info
        return info

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """The slot's file mapped as uint8 (grown when the state grew); shared, so writes land in the file. When a
        slot is mapped anew (the first save, a re-form, a bigger state), the other slots in rotation are sized,
        mapped and their pages mapped on a thread meanwhile (`_prepare_others`): the next saves copy into them
        without first-touch faults, which a re-form that comes one step later (a grow) waits for otherwise."""
        self._prepared(slot)
        path = self.dir / f"slot{slot}.bin"
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = _map_slot(path, nbytes)
            self._buffers[slot] = buf
            self._prepare_others(slot, nbytes)
        elif slot not in self._sized and path.stat().st_size > buf.numel():
            os.truncate(path, buf.numel())  # prepared beside a bigger snapshot of an earlier world, now overwritten
        self._sized.add(slot)
        return buf

    def _prepare_others(self, slot: Optional[int], nbytes: int) -> None:
        with self._lock:
            rotation = [k for k in SLOTS if k not in self._held] if self._rotate_three else [0, 1]
        for other in rotation:
            have = self._buffers.get(other)
            if other == slot or other in self._preparing or (have is not None and have.numel() >= nbytes):
                continue
            thread = threading.Thread(target=self._prepare, args=(other, nbytes), name=f"snapshot-slot{other}",
                                      daemon=True)
            self._preparing[other] = thread
            thread.start()

    def _prepare(self, slot: int, nbytes: int) -> None:
        try:
            buf = _map_slot(self.dir / f"slot{slot}.bin", nbytes, grow_only=True)
        except (OSError, RuntimeError) as e:  # /dev/shm full: the save that needs the slot meets it and says so
            log.debug("snapshot slot %d not prepared: %s", slot, e)
            return
        _populate(buf)
        self._buffers[slot] = buf

    def _prepared(self, slot: Optional[int] = None) -> None:
        """Wait for the background preparation of `slot` (None: of every slot)."""
        for k in list(self._preparing) if slot is None else [slot]:
            thread = self._preparing.pop(k, None)
            if thread is not None:
                thread.join()

    # --- loading -----------------------------------------------------------------------------------------

    def _committed(self) -> list[SnapshotInfo]:
        out = []
        for slot in SLOTS:
            try:
                out.append(SnapshotInfo(**json.loads((self.dir / f"slot{slot}.json").read_text())))
            except (OSError, ValueError, TypeError):
                continue
        return out

    def available(self) -> tuple[list[SnapshotInfo], list[str]]:
        """This job's committed snapshots, newest first, and why any other one is not usable."""
        usable, why = [], []
        for info in self._committed():
            if not same_job(info.identity, self.identity):
                differs = sorted(k for k in set(info.identity) | set(self.identity)
                                 if info.identity.get(k) != self.identity.get(k))
                why.append(f"snapshot of step {info.step} belongs to another job ({', '.join(differs)} differ)")
            elif info.identity.get("world_size") == self.identity.get("world_size"):
                usable.append(info)
            # else: this job at another world size; not this rank's own shard (snapshot_reshard.py uses it)
        return sorted(usable, key=lambda i: -i.step), why

    def restore(self, info: SnapshotInfo, state: dict[str, Any]) -> None:
        """Fill `state` in place from the snapshot `info` (from `available()`); ValueError, with nothing changed,
        when it is damaged or does not fit."""
        buf = read_slot(self.dir, info)
        meta = read_layout(self.dir, info)
        flat = _materialise(state)
        if sorted(flat) != meta["keys"]:
            raise ValueError(f"snapshot keys {meta['keys']} differ from the state's {sorted(flat)}")
        live = dict(_leaves(flat))
        targets = []
        for path, dtype, shape, off, n in meta["layout"]:  # check everything before changing anything
            target = live.get(path)
            name = "/".join(map(str, path))
            if not isinstance(target, torch.Tensor):
                raise ValueError(f"snapshot tensor {name} is not a tensor in the state")
            local = _local(target)
            if str(local.dtype).removeprefix("torch.") != dtype or tuple(local.shape) != tuple(shape):
                raise ValueError(f"snapshot tensor {name} is {dtype}{list(shape)}, the state's "
                                 f"{local.dtype}{list(local.shape)} (another sharding or model)")
            targets.append((local, off, n))
        for local, off, n in targets:
            if n:
                local.copy_(buf[off:off + n].view(local.dtype).reshape(local.shape))
        for path, value in meta["objects"]:
            _set(flat, path, value)
        for k, v in state.items():
            if isinstance(v, Stateful):
                v.load_state_dict(flat[k])
            elif isinstance(v, torch.Tensor):
                continue  # filled in place
            else:
                state[k] = flat[k]

    def drop(self, step: int) -> None:
        """Uncommit this rank's snapshot of `step` (it failed to restore somewhere: never try it again)."""
        for info in self._committed():
            if info.step == step:
                (self.dir / f"slot{info.slot}.json").unlink(missing_ok=True)

    def close(self) -> None:
        """Wait for the copy in flight (an error is logged: the snapshot stays uncommitted), release the buffers."""
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - closing: the slot stays uncommitted, nothing else to do
            log.warning("the last in-memory snapshot was not completed: %s", e)
        self._prepared()
        self._buffers.clear()


@dataclass(frozen=True)
class LiveSnapshot:
    """A snapshot whose copy was in flight, served from where its bytes are (`SnapshotStore.live`); `info.checksum`
    is 0: nothing was committed, the bytes are the live state's own."""

    rank: int
    """The rank that took it (its slot folder is `rank<rank>`), in the world of `info.identity["world_size"]`."""
    info: SnapshotInfo
    slot: "LiveSlot"


class LiveSlot:
    """A slot's bytes as `read_slot` would give them once its copy is committed, taken where they are now: byte
    ranges that lie inside one deferred tensor are views of it (no copy), others are assembled."""

    def __init__(self, buf: torch.Tensor, nbytes: int, copies: list[tuple[torch.Tensor, int, int, bool]]):
        self._buf, self.nbytes = buf, nbytes
        self._pieces = sorted(((off, n, t) for t, off, n, _ in copies if n), key=lambda p: p[0])

    def _segments(self, a: int, b: int) -> Iterator[torch.Tensor]:
        at = a
        for off, n, t in self._pieces:
            if off + n <= at:
                continue
            if off >= b:
                break
            if off > at:
                yield self._buf[at:off]
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            yield raw[max(at, off) - off:min(b, off + n) - off]
            at = min(b, off + n)
        if at < b:
            yield self._buf[at:b]

    def __getitem__(self, key: slice) -> torch.Tensor:
        a, b, step = key.indices(self.nbytes)
        if step != 1:
            raise ValueError("a live slot is read in contiguous byte ranges")
        parts = list(self._segments(a, b)) if b > a else []
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


class _Cancelled(Exception):
    pass


class _Copy:
    """The deferred part of one save, on its own thread: the copies, then the checksum and the commit marker."""

    def __init__(self, store: SnapshotStore, step: int, slot: int, buf: torch.Tensor, nbytes: int,
                 copies: list[tuple[torch.Tensor, int, int, bool]], ready: Optional[Any]):
        self.info: Optional[SnapshotInfo] = None
        self.error: Optional[BaseException] = None
        self.step, self.slot, self.buf, self.nbytes, self.copies = step, slot, buf, nbytes, copies
        self.cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(store, step, slot, buf, nbytes, copies, ready),
                                        name=f"snapshot-{step}", daemon=True)
        self._thread.start()

    def _run(self, store: SnapshotStore, step: int, slot: int, buf: torch.Tensor, nbytes: int,
             copies: list[tuple[torch.Tensor, int, int, bool]], ready: Optional[Any]) -> None:
        try:
            if ready is not None:  # device tensors: copy on a side stream once the step's kernels are done
                stream = torch.cuda.Stream()
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    _copy_into(buf, copies)
                stream.synchronize()
            else:
                _copy_into(buf, copies, self.cancel)
            if self.cancel.is_set():
                raise _Cancelled()
            self.info = store._commit(step, slot, buf, nbytes)
        except _Cancelled:
            log.debug("the snapshot copy of step %d was cancelled: its slot stays uncommitted", step)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            self.error = e

    def join(self) -> Optional[SnapshotInfo]:
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.info is not None or self.cancel.is_set()
        return self.info


def read_slot(rank_dir: Path, info: SnapshotInfo, verify: bool = True) -> torch.Tensor:
    """A committed slot's bytes, checked against its marker's size and checksum (ValueError naming what is wrong);
    `verify=False` for a slot whose checksum was checked as it was written (a copy from a peer)."""
    path = rank_dir / f"slot{info.slot}.bin"
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ValueError(f"snapshot of step {info.step} is unreadable: {e}") from None
    if size < info.nbytes:
        raise ValueError(f"snapshot of step {info.step} is truncated")
    buf = torch.from_file(str(path), shared=False, size=max(info.nbytes, 1), dtype=torch.uint8)[:info.nbytes]
    if verify and _checksum(buf) != info.checksum:
        raise ValueError(f"snapshot of step {info.step} is corrupt (checksum mismatch)")
    return buf


def read_layout(rank_dir: Path, info: SnapshotInfo) -> dict[str, Any]:
    """A slot's unpickled layout (`layout`, `objects`, `keys`, `chunks`); ValueError when it cannot be read."""
    try:
        with open(rank_dir / f"slot{info.slot}.meta", "rb") as f:
            return pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"snapshot of step {info.step}: unreadable layout ({e})") from None


def storage_key(t: torch.Tensor) -> int:
    """What identifies a tensor's memory: its storage's address (a DTensor's local shard's, read without
    `DTensor.to_local()`'s autograd call: this runs for every parameter at every snapshot)."""
    return getattr(t, "_local_tensor", t).untyped_storage().data_ptr()


def _copy_into(buf: torch.Tensor, copies: list[tuple[torch.Tensor, int, int, bool]],
               cancel: Optional[threading.Event] = None) -> None:
    for t, off, n, _ in copies:
        if cancel is not None and cancel.is_set():
            return
        buf[off:off + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))


def remove_snapshots(root: str | Path) -> None:
    """Remove a run's snapshot directory (the agent, when the job ends or the node leaves)."""
    shutil.rmtree(root, ignore_errors=True)
