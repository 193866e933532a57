"""Restoring in-memory snapshots at another world size: the old ranks' slots, wherever the group's nodes hold them,
loaded through DCP as if they were one durable checkpoint.

A slot holds one old rank's shard of the train state (checkpoint/snapshot.py); its layout records, for each DTensor,
the global shape and the shard's global offset, which is what DCP's own metadata says of a saved chunk. So the old
ranks' layouts together describe the snapshot like a durable checkpoint's `.metadata`, and `SnapshotReader` (a DCP
`StorageReader`) serves their bytes: `dcp.load` with DCP's `DefaultLoadPlanner` reshards the tensors and puts back
the non-tensor values exactly as a durable load at the new world size does. Per-rank keys (`rng/rank<r>`) are left
out, as a durable load at another world size leaves them out where they do not exist: the caller re-derives RNG
from (seed, step, rank).

Where the slots are: each node's folder holds its ranks' own slots (`rank<r>`) and its ring predecessor's replicas
(`replicas/<node>/rank<r>`). `scan` lists this job's committed slots in one node's folder, at any world size;
`newest_complete` picks the newest step whose every old rank is held on some node of the group. A rank reads the
slots on its own node in place and receives the byte ranges it needs of the others over the process group, from a
rank whose node holds them (checkpoint/snapshot_exchange.py): each slot's checksum is checked where it is held.

The order of a restore (`Reshard`): `plan()` (which old slots this rank needs: the ones whose chunks overlap its
shards, one for the values every old rank holds alike, preferring those it already reads or has on its node), then
`obtain()` (read or receive them, checksums checked), then `load()`. The caller agrees with the other ranks between
the steps, so that a missing or corrupt slot anywhere leaves every rank's state untouched: servers check their slots
and the ranks agree on it before any byte moves. What is received goes straight into the state where a load item's
bytes lie in one piece in the slot and in the destination (`ranges`: at 150M parameters all but the smallest
items), the rest into a buffer that the load copies from; a transport error during the move can leave part of the
state written, which the fallback (the durable load, or a restart when there is none) overwrites.
"""

from __future__ import annotations

import io
import logging
import math
import socket
import threading
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.stateful import Stateful
from torch.futures import Future

from elastictrain.checkpoint.compat import is_per_rank_key
from elastictrain.checkpoint.replica_wire import RANK_PATH, REPLICAS_DIR, PeerList, committed_markers
from elastictrain.checkpoint.snapshot import SnapshotInfo, read_layout, read_slot, same_job
from elastictrain.checkpoint.snapshot_exchange import MERGE_GAP, exchange

log = logging.getLogger(__name__)

IN_PLACE_MIN = MERGE_GAP
"""A load item's bytes received over the group straight into its destination from this size on; smaller ones go
into a buffer, merged with their neighbours (fewer messages), and are copied from there at the load."""


@dataclass(frozen=True)
class Holding:
    """One committed slot of this job's snapshots in a node's folder."""

    node: str
    path: str
    """The rank folder, relative to the node's snapshot folder: `rank<r>` or `replicas/<source>/rank<r>`."""
    rank: int
    world_size: int
    info: SnapshotInfo
    live: bool = False
    """Not a committed slot: the snapshot whose copy was in flight when the group re-formed to grow, served by the
    process that took it from its live state (`SnapshotStore.live`; its layout is in the slot's folder already)."""

    @property
    def replica(self) -> bool:
        return self.path.startswith(f"{REPLICAS_DIR}/")


@dataclass(frozen=True)
class Candidate:
    """A snapshot at another world size that the group can restore: each old rank's slots, preferred first."""

    step: int
    world_size: int
    holders: tuple[tuple[Holding, ...], ...]


class Shard(NamedTuple):
    """One tensor of an old rank's slot: where its bytes are, and which part of the global tensor they are."""

    key: tuple[str, ...]
    """The leaf's path, each part as a string: the parts of DCP's FQN."""
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


def node_name(root: Path) -> str:
    """This node as the agents name it (`peers.json`); without one, a name no other node has."""
    peers = PeerList.read(root)
    return peers.this_node if peers is not None else f"{socket.gethostname()}:{root}"


def scan(root: Path, identity: dict[str, Any]) -> list[Holding]:
    """This job's committed slots in a node's snapshot folder (its ranks' own and its replicas), any world size."""
    node, out = node_name(root), []
    for d in sorted(root.glob("rank*")) + sorted(root.glob(f"{REPLICAS_DIR}/*/rank*")):
        rel = d.relative_to(root).as_posix()
        m = RANK_PATH.match(rel)
        if m is None:
            continue
        for marker in committed_markers(d):
            world = marker["identity"].get("world_size")
            if isinstance(world, int) and same_job(marker["identity"], identity):
                out.append(Holding(node, rel, int(m["rank"]), world, SnapshotInfo(**marker)))
    return out


def newest_complete(holdings: list[Holding], world_size: int) -> tuple[Optional[Candidate], str]:
    """The newest snapshot at a world size other than `world_size` that every old rank is held for; else None and,
    when there are such snapshots, what the newest one lacks."""
    sets: dict[tuple[int, int], dict[int, dict[tuple, Holding]]] = defaultdict(lambda: defaultdict(dict))
    for h in holdings:
        if h.world_size != world_size and 0 <= h.rank < h.world_size:
            sets[(h.info.step, h.world_size)][h.rank][(h.node, h.path, h.info.slot)] = h
    complete = [key for key, ranks in sets.items() if len(ranks) == key[1]]
    if not complete:
        if not sets:
            return None, ""
        step, world = max(sets)
        missing = sorted(set(range(world)) - set(sets[(step, world)]))
        return None, (f"the newest snapshot at world size {world} (step {step}) lacks rank(s) "
                      f"{', '.join(map(str, missing[:8]))}{' and more' if len(missing) > 8 else ''} on every node of "
                      f"this group")
    step, world = max(complete)
    # A rank's own folder first: nothing writes it during a restore, while a lagging replica may still arrive.
    order = lambda h: (h.replica, h.node, h.path, h.info.slot)  # noqa: E731
    return Candidate(step, world, tuple(tuple(sorted(sets[(step, world)][r].values(), key=order))
                                        for r in range(world))), ""


def _key(path: tuple) -> tuple[str, ...]:
    return tuple(str(p) for p in path)


def read_shards(root: Path, holding: Holding) -> list[Shard]:
    """An old rank's tensors as its slot's layout describes them (ValueError when unreadable or too old)."""
    meta = read_layout(root / holding.path, holding.info)
    layout, chunks = meta.get("layout", []), meta.get("chunks")
    if chunks is None or len(chunks) != len(layout):
        raise ValueError(f"the snapshot of step {holding.info.step} in {holding.path} has no global layout (written "
                         f"by an older version): it cannot be resharded")
    out = []
    for (path, dtype, shape, offset, nbytes), chunk in zip(layout, chunks):
        global_shape, global_offset = chunk if chunk is not None else (tuple(shape), (0,) * len(shape))
        out.append(Shard(_key(path), dtype, tuple(shape), offset, nbytes, tuple(global_shape), tuple(global_offset)))
    return out


def _as_lists(under: dict[tuple[str, ...], Any]) -> list:
    """A list (of lists) rebuilt from its leaves, keyed by their index paths."""
    groups: dict[int, dict[tuple[str, ...], Any]] = defaultdict(dict)
    for sub, value in under.items():
        groups[int(sub[0])][sub[1:]] = value  # ValueError: not a list
    if sorted(groups) != list(range(len(groups))):
        raise ValueError("a list in the snapshot has gaps")
    return [g[()] if () in g else _as_lists(g) for g in (groups[i] for i in range(len(groups)))]


def objects_for(template: dict[str, Any], mappings: dict[str, tuple], objects: list[tuple[tuple, Any]]
                ) -> dict[str, Any]:
    """The saved value of every non-tensor FQN of the flattened template (DCP leaves: a value, or a whole list of
    plain values, which the snapshot keeps element by element)."""
    leaves = {_key(p): v for p, v in objects}
    out = {}
    for fqn, value in template.items():
        if isinstance(value, torch.Tensor):
            continue
        key = _key(mappings[fqn])
        if key in leaves:
            out[fqn] = leaves[key]
            continue
        under = {k[len(key):]: v for k, v in leaves.items() if k[:len(key)] == key and len(k) > len(key)}
        if not under:
            raise ValueError(f"{fqn} is not in the snapshot")
        try:
            out[fqn] = _as_lists(under)
        except ValueError:
            raise ValueError(f"{fqn} has another structure in the snapshot") from None
    return out


def _typed(buf: torch.Tensor, shard: Shard) -> torch.Tensor:
    raw = buf[shard.offset:shard.offset + shard.nbytes]
    dtype = getattr(torch, shard.dtype)
    if shard.offset % dtype.itemsize:
        raw = raw.clone()  # a view as a wider type needs an aligned start
    return raw.view(dtype).reshape(shard.shape)


class SnapshotReader(dcp.StorageReader):
    """DCP's view of a snapshot's old slots: metadata built from their layouts, bytes from their buffers.

    The metadata covers the template's FQNs; `assigned` maps each stored chunk this rank reads to the old rank
    it reads it from, `buffers` holds those ranks' bytes and `objects` the non-tensor values (`Reshard` fills both).
    """

    def __init__(self, metadata: Metadata):
        super().__init__()
        self.metadata = metadata
        self.assigned: dict[MetadataIndex, tuple[int, Shard]] = {}
        self.buffers: dict[int, torch.Tensor] = {}
        self.objects: dict[str, Any] = {}
        self.in_place: set[ReadItem] = set()
        """Items already in their destination (received there over the group): the load skips them."""

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        unserved = [i.storage_index.fqn for i in plan.items
                    if i.type != LoadItemType.BYTE_IO and i.storage_index not in self.assigned]
        if unserved:
            raise ValueError(f"the load plan reads chunks that were not prepared: {unserved[:4]}")
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                data = io.BytesIO()
                torch.save(self.objects[item.storage_index.fqn], data)
                data.seek(0)
                planner.load_bytes(item, data)
                continue
            if item in self.in_place:
                planner.commit_tensor(item, planner.resolve_tensor(item).detach())
                continue
            rank, shard = self.assigned[item.storage_index]
            source = narrow_tensor_by_index(_typed(self.buffers[rank], shard), item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise ValueError(f"{item.storage_index.fqn}: chunk of {tuple(source.size())} for a target of "
                                 f"{tuple(target.size())}")
            target.copy_(source)
            planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _metadata(template: dict[str, Any], mappings: dict[str, tuple], shards: dict[int, list[Shard]]
              ) -> tuple[Metadata, dict[MetadataIndex, list[tuple[int, Shard]]]]:
    """DCP metadata of the template's FQNs as the old ranks stored them, and every stored chunk's holders (a chunk
    every old rank holds alike, e.g. a plain tensor, has them all). A template tensor missing from the snapshot is
    left out: DCP's planner then names it."""
    chunks: dict[tuple[str, ...], dict[tuple[int, ...], list[tuple[int, Shard]]]]
    chunks = defaultdict(lambda: defaultdict(list))
    for rank in sorted(shards):
        for shard in shards[rank]:
            chunks[shard.key][shard.global_offset].append((rank, shard))
    entries: dict[str, Any] = {}
    holders: dict[MetadataIndex, list[tuple[int, Shard]]] = {}
    for fqn, value in template.items():
        if not isinstance(value, torch.Tensor):
            entries[fqn] = BytesStorageMetadata()
            continue
        stored = chunks.get(_key(mappings[fqn]))
        if stored is None:
            continue
        first = next(iter(stored.values()))[0][1]
        if any(s.global_shape != first.global_shape for held in stored.values() for _, s in held):
            raise ValueError(f"{fqn} has different global shapes in the old ranks' snapshots")
        nonempty = {o: held for o, held in stored.items() if held[0][1].nbytes}
        covered = sum(torch.Size(held[0][1].shape).numel() for held in nonempty.values())
        if covered != torch.Size(first.global_shape).numel():
            raise ValueError(f"{fqn}: the old ranks' shards cover {covered} of its "
                             f"{torch.Size(first.global_shape).numel()} elements")
        entries[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=getattr(torch, first.dtype)), torch.Size(first.global_shape),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(held[0][1].shape)) for o, held in nonempty.items()])
        for o, held in nonempty.items():
            holders[MetadataIndex(fqn, o)] = held
    return Metadata(state_dict_metadata=entries), holders


class Reshard:
    """One rank's restore of a `Candidate` into `state` (a DCP state dict: Stateful or plain values)."""

    def __init__(self, candidate: Candidate, shards: dict[int, list[Shard]], state: dict[str, Any], root: Path,
                 node: str, live: Optional[dict[int, Any]] = None):
        """`live`: old rank -> the `LiveSlot` of its snapshot that this process took (a grow in place), read instead
        of a committed slot."""
        self.candidate, self.state, self.root, self.node = candidate, state, root, node
        self.live = live or {}
        self.read_live = 0
        """How many old ranks' snapshots this rank read (or served) from the live state."""
        t0 = time.monotonic()
        self.template = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()
                         if not is_per_rank_key(k)}
        self.template_s = time.monotonic() - t0
        """The seconds the state's dicts took (a fresh optimizer's state allocated there, `OptimizerState`)."""
        flat, self.mappings = flatten_state_dict(self.template)
        self.flat = flat
        metadata, self.holders = _metadata(flat, self.mappings, shards)
        self.reader = SnapshotReader(metadata)
        self.fetched_from: list[str] = []
        """The node of each old rank's slot this rank copied from a peer or received over the group."""
        self.fetched_bytes = 0
        """The bytes of those: whole slots copied, the ranges received."""
        self.received = 0
        """How many of those came over the group (snapshot_exchange.py)."""
        self.in_place_bytes = 0
        """The received bytes that went straight into the state (`ranges`)."""
        self.wrote_state = False
        """Whether receives into the state were posted: a failure after that can leave it partly written."""
        self.items: list = []

    def plan(self) -> set[int]:
        """Which old ranks' slots this rank reads (DCP's own plan for the template), each chunk assigned to one."""
        planner = dcp.DefaultLoadPlanner()
        planner.set_up_planner(self.template, self.reader.metadata)
        items = [i for i in planner.create_local_plan().items if i.type != LoadItemType.BYTE_IO]
        self.items, self._planner = items, planner
        local = {r for r, holders in enumerate(self.candidate.holders) if any(h.node == self.node for h in holders)}
        need: set[int] = set()
        shared = []
        for index in dict.fromkeys(i.storage_index for i in items):
            held = self.holders[index]
            if len(held) == 1:
                self.reader.assigned[index] = held[0]
                need.add(held[0][0])
            else:
                shared.append((index, held))
        for index, held in shared:  # the same bytes on several old ranks: from one this rank reads anyway
            pick = min(held, key=lambda rs: (rs[0] not in need, rs[0] not in local, rs[0]))
            self.reader.assigned[index] = pick
            need.add(pick[0])
        self.objects_rank = min(need) if need else min(local, default=0)
        return need | {self.objects_rank}

    def _spans(self, rank: int) -> list[tuple[ReadItem, Shard, int, int]]:
        """Per load item reading old rank `rank`'s slot: the [start, end) bytes of the slot from its first to its last
        element, exact for the rows of a dim-0 shard."""
        out = []
        for item in self.items:
            old, shard = self.reader.assigned[item.storage_index]
            if old != rank or not shard.nbytes or not all(item.lengths):
                continue
            itemsize = getattr(torch, shard.dtype).itemsize
            strides = torch.empty(shard.shape, device="meta").stride()  # a contiguous tensor's, nothing allocated
            first = sum(o * s for o, s in zip(item.storage_offsets, strides))
            last = sum((o + n - 1) * s for o, n, s in zip(item.storage_offsets, item.lengths, strides))
            out.append((item, shard, shard.offset + first * itemsize, shard.offset + (last + 1) * itemsize))
        return out

    def _in_place_target(self, item: ReadItem, shard: Shard, start: int, end: int) -> Optional[torch.Tensor]:
        """The bytes of `item`'s destination, if the span `start`-`end` of the slot can be received straight into
        them: the span holds exactly the item's elements (nothing between its rows), the destination is a contiguous
        CPU tensor of the stored dtype, and the span is at least IN_PLACE_MIN bytes (smaller ones are merged)."""
        if end - start < IN_PLACE_MIN or end - start != math.prod(item.lengths) * getattr(torch, shard.dtype).itemsize:
            return None
        target = self._planner.resolve_tensor(item).detach()
        if (target.device.type != "cpu" or target.dtype != getattr(torch, shard.dtype) or not target.is_contiguous()
                or target.numel() * target.element_size() != end - start):
            return None
        return target.view(-1).view(torch.uint8)

    def ranges(self, rank: int) -> tuple[list[tuple[int, int]], list[tuple[tuple[int, int], torch.Tensor, ReadItem]]]:
        """What this rank's load reads of old rank `rank`'s slot (after `plan`), split in two: the [start, end) byte
        ranges to read from a buffer, and the items that can be received straight into their destination in the
        state (no buffer, no copy at the load), each as (byte range, destination bytes, load item). Once those are
        there, `reader.in_place` names the items so that the load skips them."""
        buffered, into = [], []
        for item, shard, a, b in self._spans(rank):
            target = self._in_place_target(item, shard, a, b)
            if target is None:
                buffered.append((a, b))
            else:
                into.append(((a, b), target, item))
        return buffered, into

    def _local_holding(self, rank: int) -> Optional[Holding]:
        return next((h for h in self.candidate.holders[rank] if h.node == self.node), None)

    def read_local(self, rank: int) -> None:
        """Old rank `rank`'s slot on this node into the reader's buffers (mapped, checksum checked), unless there."""
        if rank in self.reader.buffers:
            return
        holding = self._local_holding(rank)
        assert holding is not None
        if holding.live:
            if rank not in self.live:  # one process per node serves a live snapshot (runtime/checkpointing.py)
                raise ValueError(f"old rank {rank}'s snapshot of step {holding.info.step} on node {self.node} is held "
                                 f"by another process's live state")
            self.reader.buffers[rank] = self.live[rank]
            self.read_live += 1
            return
        try:
            self.reader.buffers[rank] = read_slot(self.root / holding.path, holding.info)
        except ValueError as e:
            raise ValueError(f"old rank {rank}'s slot in {holding.path} on node {self.node}: {e}") from None

    def local_objects(self, rank: int) -> list:
        """The non-tensor values as old rank `rank`'s slot on this node holds them (its layout's `objects`)."""
        holding = self._local_holding(rank)
        assert holding is not None
        return read_layout(self.root / holding.path, holding.info)["objects"]

    def set_objects(self, objects: list) -> None:
        self.reader.objects = objects_for(self.flat, self.mappings, objects)

    def obtain(self, ranks: set[int], group: Optional[tuple[list[str], int, Callable[[Any], list[Any]]]] = None
               ) -> None:
        """Read (this node) or receive over the group (a collective, snapshot_exchange.py; `group`: each new rank's
        node, this rank, an all-gather) each old rank's slot, checksums checked where they are held; the non-tensor
        values from one of them. ValueError naming what is missing or damaged."""
        received = exchange(self, ranks, *group) if group is not None and len(group[0]) > 1 else set()
        for rank in sorted(ranks - received):
            holding = self._local_holding(rank)
            if holding is None:  # every slot listed is on a node of the group (its ranks list them): not expected
                raise ValueError(f"old rank {rank}'s snapshot of step {self.candidate.step} is on node(s) "
                                 f"{', '.join(sorted({h.node for h in self.candidate.holders[rank]}))}, none of "
                                 f"which runs a rank of this group")
            self.read_local(rank)
            if rank == self.objects_rank:
                self.set_objects(self.local_objects(rank))

    def load(self) -> None:
        """DCP's load into the template (no collective: every rank has its own reader), then the Statefuls."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(self.template, storage_reader=self.reader, planner=dcp.DefaultLoadPlanner(), no_dist=True)
        for k, v in self.state.items():
            if k not in self.template:
                continue
            if isinstance(v, Stateful):
                v.load_state_dict(self.template[k])
            elif not isinstance(v, torch.Tensor):
                self.state[k] = self.template[k]

    def close(self) -> None:
        """Release the buffers (mapped slots, received ranges) on a thread of their own: unmapping them takes
        ~0.15 s of a 150M shrink's restore (1.9 GB), which the pause need not wait for."""
        buffers, self.reader.buffers = self.reader.buffers, {}
        if buffers:
            threading.Thread(target=buffers.clear, name="snapshot-unmap", daemon=True).start()
