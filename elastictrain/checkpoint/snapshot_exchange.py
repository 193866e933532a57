"""Old slots' bytes moved over the restoring group itself (a grow in place, a re-join): a rank whose node holds no
copy of an old rank's slot gets only the byte ranges its load reads, point to point from a rank whose node holds one.

Before this, such a rank copied the whole slot from the holder's agent over HTTP into a scratch file, then read the
half (in a 1 -> 2 grow) that its shards overlap: at 150M parameters 1.9 GB copied for 0.9 GB used, 7.5-9 s of the
grow's 11 s pause. Here the process group that the restore runs in anyway carries the bytes (gloo: CPU tensors go
over it on CUDA too, the default group being `cpu:gloo,cuda:nccl`), straight from the holder's mapped slot into the
receiver's buffer: no file, no HTTP, half the bytes.

The exchange is one collective of the whole group (`exchange`), every rank calls it, in three parts: every rank
says which ranges of which old slots it asks for (and the ranks that need no bytes say so); each ask goes to one
rank whose node holds the slot (the lowest that reads the slot for itself anyway, else the lowest), which reads and
checks the whole slot's checksum (as a local read does) and answers with the slot's non-tensor values if asked; the
ranks agree on every server's outcome (a missing or corrupt slot anywhere: ValueError on every rank, nothing moved);
then the ranges move with `isend`/`irecv`, one message per range: a load item that lies in one piece in the slot and
in its destination (`Restore.ranges`) is received straight into the state (no buffer to fault in, no copy at
the load: a 1 -> 2 restore alone, benchmarks/grow_restore.py, took 1.09 s instead of 1.85 s at 50M parameters and
2.16 s instead of 2.75 s at 150M), the smaller ones merged into a buffer. Every slot a restore can choose is held on
a node of the group (the group's ranks list the slots), so there is always a server; the agents' HTTP copy of a slot
stays for a replacement at the same world size that lacks its own slot (checkpoint/replica_fetch.py).

Integrity: the server checks the slot against its commit marker before sending; the receiver cannot check a part
of a slot against the whole slot's checksum, and relies on the sender's check and the transport (TCP).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist

from elastictrain.checkpoint.buffers import unfilled

log = logging.getLogger(__name__)

MERGE_GAP = 1 << 16
"""Ranges of one slot closer than this are asked for as one (fewer messages; the gap's bytes come along)."""


@dataclass(frozen=True)
class Ask:
    """What one rank asks of an old rank's slot."""

    old_rank: int
    ranges: tuple[tuple[int, int], ...]
    """[start, end) byte ranges of the slot: the merged ones that go into a buffer (sorted, apart), then those that
    go straight into place (one per load item)."""
    objects: bool
    """The slot's non-tensor values too (the asking rank reads them from this slot)."""


class Restore(Protocol):
    """What the exchange uses of a restore (`snapshot_reshard.Reshard`)."""

    candidate: Any
    """`.holders[old rank]`: the `Holding`s of that old rank's slot (`.node`, `.info.nbytes`)."""
    node: str
    objects_rank: int
    reader: Any
    """`.buffers`: old rank -> its slot's bytes."""
    fetched_from: list[str]
    fetched_bytes: int
    received: int
    in_place_bytes: int
    wrote_state: bool

    def ranges(self, rank: int) -> tuple[list[tuple[int, int]], list[tuple[tuple[int, int], torch.Tensor, Any]]]: ...
    def read_local(self, rank: int) -> None: ...
    def local_objects(self, rank: int) -> list: ...
    def set_objects(self, objects: list) -> None: ...


def merge(ranges: list[tuple[int, int]], gap: int = MERGE_GAP) -> tuple[tuple[int, int], ...]:
    """Sorted ranges with those that overlap, touch or lie closer than `gap` joined."""
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def servers(asks: list[tuple[Ask, ...]], needs: list[tuple[int, ...]], holders: list[set[str]],
            nodes: list[str]) -> dict[tuple[int, int], int]:
    """For each (asking rank, old rank): the rank that serves it. The same on every rank (it depends only on what
    every rank said): among the ranks whose node holds the old slot, the lowest that reads it for itself, else
    the lowest."""
    out = {}
    for r, mine in enumerate(asks):
        for ask in mine:
            able = [s for s in range(len(nodes)) if s != r and nodes[s] in holders[ask.old_rank]]
            if able:
                out[(r, ask.old_rank)] = min(able, key=lambda s: (ask.old_rank not in needs[s], s))
    return out


def exchange(reshard: Restore, need: set[int], nodes: list[str], rank: int,
             all_gather: Callable[[Any], list[Any]]) -> set[int]:
    """The collective described in the module doc; which of `need` arrived over the group (their buffers and, if
    asked, the non-tensor values are in `reshard.reader`). ValueError (on every rank) when a server failed."""
    holders = [{h.node for h in hs} for hs in reshard.candidate.holders]
    group_nodes = set(nodes)
    mine: tuple[Ask, ...] = ()
    direct: dict[int, list[tuple[tuple[int, int], torch.Tensor, Any]]] = {}
    error: Optional[str] = None
    try:
        for q in sorted(need):
            if reshard.node not in holders[q] and holders[q] & (group_nodes - {reshard.node}):
                buffered, direct[q] = reshard.ranges(q)
                mine += (Ask(q, merge(buffered) + tuple(r for r, _, _ in direct[q]), q == reshard.objects_rank),)
    except Exception as e:  # noqa: BLE001 - every rank must reach the gather; the error is raised after it
        error = f"{type(e).__name__}: {e}"
    said = all_gather((mine, tuple(sorted(need)), error))
    failed = [f"rank {s}: {e}" for s, (_, _, e) in enumerate(said) if e]
    if failed:
        raise ValueError("the ranges to move over the group could not be planned: " + "; ".join(failed))
    asks, needs = [a for a, _, _ in said], [n for _, n, _ in said]
    served_by = servers(asks, needs, holders, nodes)
    if not served_by:
        return set()
    objects: dict[tuple[int, int], Any] = {}
    to_send = [(r, ask) for r in range(len(asks)) for ask in asks[r] if served_by.get((r, ask.old_rank)) == rank]
    try:
        for r, ask in to_send:
            reshard.read_local(ask.old_rank)
            if ask.objects:
                objects[(r, ask.old_rank)] = reshard.local_objects(ask.old_rank)
    except ValueError as e:
        error = str(e)
    outcomes = all_gather((error, objects))
    failed = [f"rank {s}: {e}" for s, (e, _) in enumerate(outcomes) if e]
    if failed:
        raise ValueError("a slot could not be served over the group: " + "; ".join(failed))
    works = []
    for r, ask in to_send:
        buf = reshard.reader.buffers[ask.old_rank]
        for tag, (a, b) in enumerate(ask.ranges):
            works.append(dist.isend(buf[a:b], dst=r, tag=_tag(ask.old_rank, tag)))
    got: dict[int, int] = {}
    for ask in asks[rank]:
        server = served_by.get((rank, ask.old_rank))
        if server is None:
            continue
        with unfilled():  # only the received ranges are ever read, and no page is touched before a message lands
            buf = torch.empty(reshard.candidate.holders[ask.old_rank][0].info.nbytes, dtype=torch.uint8)
        into = direct.get(ask.old_rank, [])
        buffered = len(ask.ranges) - len(into)
        reshard.wrote_state |= bool(into)
        for tag, (a, b) in enumerate(ask.ranges):
            target = buf[a:b] if tag < buffered else into[tag - buffered][1]
            works.append(dist.irecv(target, src=server, tag=_tag(ask.old_rank, tag)))
        reshard.reader.buffers[ask.old_rank] = buf
        reshard.fetched_bytes += sum(b - a for a, b in ask.ranges)
        got[ask.old_rank] = server
    for w in works:
        w.wait()
    for q in got:
        reshard.reader.in_place.update(item for _, _, item in direct.get(q, []))
        reshard.in_place_bytes += sum(b - a for (a, b), _, _ in direct.get(q, []))
    for ask in asks[rank]:  # after every message: a ValueError here leaves no peer waiting on this rank
        if ask.objects and ask.old_rank in got:
            reshard.set_objects(outcomes[got[ask.old_rank]][1][(rank, ask.old_rank)])
    reshard.received += len(got)
    reshard.fetched_from.extend(nodes[server] for server in got.values())
    if got:
        log.info("received %d bytes of %d old slot(s) over the process group from rank(s) %s",
                 reshard.fetched_bytes, len(got), sorted(set(got.values())))
    return set(got)


def _tag(old_rank: int, index: int) -> int:
    """A message's tag: unique per (server, receiver) pair, as each pair's asks name an old rank once."""
    return old_rank * 100_000 + index % 100_000
