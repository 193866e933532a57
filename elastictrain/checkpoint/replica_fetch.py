"""A restarting worker's side of peer replicas: which agents hold a snapshot of its rank (their workers' own or a
replica), and the copy of one into the worker's own snapshot folder, where `SnapshotStore` restores it as its own;
also the copy of any slot a restore at another world size needs (checkpoint/snapshot_reshard.py).

The agents' list is `peers.json` in the node's snapshot folder, kept current by the agent from the job's etcd node
records (agent/replication.py): read when the restore runs, after the rendezvous, so it names the agents of this
round. This node's agent is on it too: after a re-form the ranks may have moved, and the snapshot a rank needs may
be a replica its own node received.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastictrain.checkpoint.replica_wire import Peer, PeerList, fetch, held, slot_to_write
from elastictrain.checkpoint.snapshot import same_job
from elastictrain.errors import SnapshotReplicaError

log = logging.getLogger(__name__)

LIST_TIMEOUT_S = 5.0
"""How long a peer's agent may take to list what it holds (an agent that does not answer offers nothing)."""
FETCH_TIMEOUT_S = 60.0
"""How long a copy from a peer may stall (per read), not its whole duration."""
_ASK_AT_ONCE = 8


@dataclass(frozen=True)
class Offer:
    """A committed slot of this rank's snapshot that an agent holds, at `path` in its folder."""

    peer: Peer
    path: str
    slot: int
    step: int


def _differs(a: dict[str, Any], b: dict[str, Any]) -> str:
    return ", ".join(sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)))


def find_offers(root: Path, rank: int, identity: dict[str, Any]) -> tuple[dict[int, Offer], list[str]]:
    """step -> where to copy `rank`'s snapshot of that step from (this node's agent first), and why any other slot
    found (or agent asked) does not serve."""
    peers = PeerList.read(root)
    if peers is None:
        return {}, []
    ordered = sorted(peers.peers, key=lambda p: p.node != peers.this_node)

    def ask(peer: Peer) -> tuple[Peer, list[tuple[str, dict[str, Any]]], str]:
        try:
            return peer, held(peer, rank, LIST_TIMEOUT_S), ""
        except SnapshotReplicaError as e:
            return peer, [], str(e)

    with ThreadPoolExecutor(max_workers=min(_ASK_AT_ONCE, len(ordered)) or 1) as pool:
        answers = list(pool.map(ask, ordered))
    offers: dict[int, Offer] = {}
    why: list[str] = []
    for peer, entries, error in answers:
        if error:
            why.append(error)
        for path, marker in entries:
            if peer.node == peers.this_node and path == f"rank{rank}":
                continue  # this rank's own folder: SnapshotStore judged it already
            if not same_job(marker["identity"], identity):
                why.append(f"{path} (step {marker['step']}) on {peer.node} belongs to another job "
                           f"({_differs(marker['identity'], identity)} differ)")
                continue
            if marker["identity"].get("world_size") != identity.get("world_size"):
                # Not this rank's shard at this world size; snapshot_reshard.py loads such snapshots when every
                # old rank's slot is on a node of the group.
                why.append(f"{path} (step {marker['step']}) on {peer.node} was taken at world size "
                           f"{marker['identity'].get('world_size')}")
                continue
            offers.setdefault(marker["step"], Offer(peer, path, marker["slot"], marker["step"]))
    return offers, why


def fetch_offer(offer: Offer, rank_dir: Path) -> None:
    """Copy the offered slot into this rank's folder (over its slot with no or the older snapshot) and commit it
    there, checksum checked; SnapshotReplicaError when the copy fails."""
    fetch_slot(offer.peer, offer.path, offer.slot, rank_dir, slot_to_write(rank_dir))


def fetch_slot(peer: Peer, path: str, slot: int, into: Path, into_slot: int = 0) -> dict[str, Any]:
    """Copy `path/slot<slot>` from the peer's folder into `into/slot<into_slot>`, checksum checked, and commit it
    there; its marker as committed. SnapshotReplicaError when the copy fails."""
    started = time.monotonic()
    marker = fetch(peer, path, slot, into, into_slot, FETCH_TIMEOUT_S)
    log.info("copied the snapshot of step %d (%d bytes) from %s on node %s in %.2fs", marker["step"], marker["nbytes"],
             path, peer.node, time.monotonic() - started)
    return marker
