"""Peer replicas of the node's in-memory snapshots: each local rank's newest committed snapshot is copied to the
agent of the next node in the job's ring, so that a lost node's state survives on its peer.

The ring: the live agents of the job that run a replica server (their etcd node records `nodes/<node>`, bound to
their leases, so a lost agent leaves the ring when its lease expires), sorted by node id; each node sends to the
next and receives from the one before. One thread polls the snapshot folder every `POLL_S` and sends each rank's
newest committed slot once (in chunks, one transfer at a time: the workers lose nothing but the copy's share of
CPU and memory bandwidth). It gives way to restores: while this node's server copies a slot to a restoring worker,
and while a local worker is paused in place or loads its state (a re-form moves its snapshot over the process
group: the replica, as large as the whole slot, would take the same link and cores), no replica is sent (for at
most `RESTORE_HOLD_MAX_S`), and a send in flight stops and goes again later. A snapshot counts as replicated when
the peer has confirmed its checksum. A peer that cannot be reached costs nothing but the replica: training goes on
with local-only snapshots, retried with backoff, reported once per streak (`checkpoint_snapshot_replica_failed`);
the first replica on each new peer is reported too (`checkpoint_snapshot_replicated`), every later one only at debug
level.

The same thread keeps `peers.json` in the folder current (every live agent's server, for a restarting worker that
lacks its rank's snapshot: checkpoint/replica_fetch.py).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from elastictrain.checkpoint.replica_server import ReplicaServer
from elastictrain.checkpoint.replica_tls import ReplicaTLS
from elastictrain.checkpoint.replica_wire import (
    Peer,
    PeerList,
    SlotReader,
    committed_markers,
    held,
    push,
    safe_node,
)
from elastictrain.errors import SnapshotReplicaError
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.liveness import NodeLiveness

log = logging.getLogger(__name__)

POLL_S = 0.02
"""How often the folder is checked for newly committed snapshots: the replica's lag behind the snapshot beyond
the transfer itself. A poll lists the folder and stats each rank's folder (a commit renames its marker in, which
moves the folder's mtime); the markers are read only when that changed: a few microseconds per poll."""
MEMBERS_S = 1.0
"""How often the ring is re-read from etcd."""
SEND_TIMEOUT_S = 10.0
"""How long one send may stall (per socket operation) before the peer counts as unreachable; the ring is not
re-read meanwhile."""
RETRY_MAX_S = 5.0
"""The longest wait before trying an unreachable peer again (doubling from four polls)."""

RESTORE_HOLD_MAX_S = 60.0
"""The longest the replicas wait for local workers that stay paused or loading: a re-form takes seconds, but an
operator's pause (phase `paused` too) lasts as long as it lasts, and the newest snapshot must reach the peer."""

_RANK_DIR = re.compile(r"^rank(\d+)$")
_MTIME_SETTLED_NS = 50_000_000
"""A folder's mtime is trusted as "nothing new" only once it is this old: file systems stamp it from a coarse clock
(a jiffy, 1-10 ms), so a marker removed and its successor renamed in within one tick can leave it unchanged."""


class Replicator:
    """Runs the node's replica server (its address and token in this node's etcd record) and sends the local
    ranks' snapshots to the ring peer; `close()` stops both."""

    def __init__(self, folder: Path, client: EtcdClient, run_prefix: str, liveness: NodeLiveness, host: str,
                 emit: Callable[[str, dict[str, Any]], None], poll_s: float = POLL_S, rate: Optional[int] = None,
                 tls: Optional[ReplicaTLS] = None, restoring: Callable[[], bool] = lambda: False):
        """`rate`: bytes per second the replicas may take (elastic.replica_bandwidth; None: as fast as they go);
        `tls`: serve and connect over mutual TLS (elastic.replica_tls); `restoring`: whether a local worker is paused
        or restores (the agent's heartbeat view): the replicas wait meanwhile."""
        self.rate, self.tls, self.restoring = rate, tls, restoring
        self.folder, self.client, self.node, self.poll_s = folder, client, liveness.node_id, poll_s
        self._nodes_prefix = f"{run_prefix.rstrip('/')}/nodes/"
        self._emit = emit
        self.server = ReplicaServer(folder, host, self.node, secrets.token_hex(16), tls)
        self._liveness = liveness
        self._published = False
        self.peer: Optional[Peer] = None
        """The ring peer this node's snapshots go to; None while it is alone (local-only)."""
        self._peers: Optional[list[Peer]] = None
        self._sent: dict[int, tuple[str, int, int]] = {}
        """rank -> (peer node, step, checksum) of the newest replica that peer confirmed."""
        self._seen: dict[int, tuple[str, int]] = {}
        """rank -> (peer node, the rank folder's mtime) when its newest commit was last sent or found sent."""
        self._announced: Optional[str] = None
        self._failing: Optional[str] = None
        self._backoff = 0.0
        self._retry_at = 0.0
        self._restoring_since: Optional[float] = None
        self._stop = threading.Event()
        self.refresh_members()
        self._thread = threading.Thread(target=self._loop, name="snapshot-replicator", daemon=True)
        self._thread.start()

    def refresh_members(self) -> None:
        """Re-read the ring from etcd: `peers.json` and the ring peer follow (an etcd error keeps the last ring)."""
        try:
            if not self._published:
                self._liveness.publish(replica=self.server.peer().record())
                self._published = True
            records = self.client.get_prefix(self._nodes_prefix, tolerance=MEMBERS_S)
        except Exception as e:  # noqa: BLE001 - etcd down: keep replicating to the peer we know
            log.debug("could not publish or read the job's node records: %s", e)
            return
        peers = []
        for key, raw in records.items():
            try:
                peer = replace(Peer(**json.loads(raw)["replica"]), client_tls=self.tls)
            except (ValueError, TypeError, KeyError):
                continue  # an agent without a replica server (plain torchrun, an older version)
            if peer.node == key[len(self._nodes_prefix):] and safe_node(peer.node):
                peers.append(peer)
        peers.sort(key=lambda p: p.node)
        others = [p for p in peers if p.node != self.node]
        peer = next((p for p in others if p.node > self.node), others[0] if others else None)
        if peer != self.peer:
            log.info("in-memory snapshots of node %s now replicate to %s", self.node,
                     peer.node if peer is not None else "no peer (alone in the job: local-only)")
            self.peer, self._backoff, self._retry_at = peer, 0.0, 0.0
        if peers != self._peers:  # after the ring peer: whoever sees the new list sees the peer that goes with it
            PeerList(self.node, peers, self.tls).write(self.folder)
            self._peers = peers

    def replicate(self) -> None:
        """Send each local rank's newest committed snapshot that the ring peer has not confirmed yet."""
        peer = self.peer
        if peer is None or time.monotonic() < self._retry_at or self._give_way():
            return
        for rank, rank_dir in self._ranks():
            try:
                seen = (peer.node, rank_dir.stat().st_mtime_ns)
            except OSError:
                continue
            if self._seen.get(rank) == seen:
                continue  # no commit (nor any other change) in that folder since it was last handled for this peer
            newest = committed_markers(rank_dir)[:1]
            if newest and self._sent.get(rank) != (peer.node, newest[0]["step"], newest[0]["checksum"]) \
                    and not self._held(peer, rank, newest[0]):
                reader = SlotReader.open(rank_dir, newest[0]["slot"])
                if reader is not None and not self._send(peer, rank, reader):
                    return
            if time.time_ns() - seen[1] > _MTIME_SETTLED_NS:
                self._seen[rank] = seen

    def _held(self, peer: Peer, rank: int, marker: dict[str, Any]) -> bool:
        """Whether `peer` holds this snapshot already, before the first send of `rank` to it: a rank restarted on a
        new node copies its slot from the peer that held the lost node's replica (checkpoint/replica_fetch.py), and
        sending it back (the whole train state's shard, 1.2 GB at 150M) took 2.3 s of the cores the first step
        after the restore trains on. Counted as replicated then; the next snapshot goes out as usual (and the peer
        drops the old sender's replica of that rank as it arrives)."""
        sent = self._sent.get(rank)
        if sent is not None and sent[0] == peer.node:
            return False  # this peer has had this rank's snapshots from us: the newest is new to it
        try:
            entries = held(peer, rank, SEND_TIMEOUT_S)
        except SnapshotReplicaError as e:
            log.debug("could not list what %s holds of rank %d: %s", peer.node, rank, e)
            return False
        same = ("step", "checksum", "nbytes", "identity")  # identity: run, fingerprint, world size, checkpoint URL
        if not any(all(m.get(k) == marker.get(k) for k in same) for _, m in entries):
            return False
        self._sent[rank] = (peer.node, marker["step"], marker["checksum"])
        log.info("node %s holds rank %d's snapshot of step %d already (checksum confirmed): not sent again",
                 peer.node, rank, marker["step"])
        return True

    def _give_way(self) -> bool:
        """A restore is under way on this node (a worker copying a slot from this node's server, or a local worker
        paused or loading): the replica waits, the restore is the hurry."""
        if self.server.serving > 0:
            return True
        try:
            restoring = self.restoring()
        except Exception as e:  # noqa: BLE001 - the agent's view unreadable: replicate as before
            log.debug("could not tell whether a local worker restores: %s", e)
            restoring = False
        now = time.monotonic()
        if not restoring:
            self._restoring_since = None
            return False
        if self._restoring_since is None:
            self._restoring_since = now
        return now - self._restoring_since < RESTORE_HOLD_MAX_S

    def _ranks(self) -> Iterator[tuple[int, Path]]:
        try:
            dirs = sorted(self.folder.iterdir())
        except OSError:
            return
        for d in dirs:
            m = _RANK_DIR.match(d.name)
            if m:
                yield int(m[1]), d

    def _send(self, peer: Peer, rank: int, reader: SlotReader) -> bool:
        step, started = reader.marker["step"], time.monotonic()
        try:
            confirmed = push(peer, self.node, rank, reader, SEND_TIMEOUT_S, self.rate,
                             give_way=lambda: self._give_way() or self._stop.is_set())
        except SnapshotReplicaError as e:
            self._failed(peer, rank, step, e)
            return False
        if confirmed is None:
            log.debug("rank %d's snapshot of step %d was rewritten while being sent, or gave way to a restore; "
                      "sending it again later", rank, step)
            return True
        self._sent[rank] = (peer.node, step, confirmed)
        self._backoff = 0.0
        fields = {"peer": peer.node, "rank": rank, "step": step, "bytes": reader.nbytes,
                  "seconds": round(time.monotonic() - started, 3)}
        if self._announced != peer.node:
            self._announced, self._failing = peer.node, None
            log.info("in-memory snapshots replicate to node %s (rank %d, step %d: %d bytes in %.3fs)", peer.node,
                     rank, step, reader.nbytes, fields["seconds"])
            self._emit("checkpoint_snapshot_replicated", fields)
        else:
            log.debug("replicated %s", fields)
        return True

    def replicated(self) -> tuple[Optional[int], Optional[str]]:
        """The newest snapshot step the current ring peer has confirmed (of any local rank), and that peer."""
        peer = self.peer
        if peer is None:
            return None, None
        steps = [step for node, step, _ in self._sent.values() if node == peer.node]
        return (max(steps) if steps else None), peer.node

    def _failed(self, peer: Peer, rank: int, step: int, error: SnapshotReplicaError) -> None:
        self._backoff = min(RETRY_MAX_S, max(4 * self.poll_s, 2 * self._backoff))
        self._retry_at = time.monotonic() + self._backoff
        if self._failing == peer.node:
            log.debug("replica to %s failed again: %s", peer.node, error)
            return
        self._failing, self._announced = peer.node, None
        log.warning("in-memory snapshots are local-only: rank %d's snapshot of step %d could not be replicated to "
                    "node %s (%s); training goes on, retrying", rank, step, peer.node, error)
        self._emit("checkpoint_snapshot_replica_failed", {"peer": peer.node, "rank": rank, "step": step,
                                                          "error": str(error)})

    def _loop(self) -> None:
        members_at = time.monotonic() + MEMBERS_S
        while not self._stop.wait(self.poll_s):
            try:
                if time.monotonic() >= members_at:
                    self.refresh_members()
                    members_at = time.monotonic() + MEMBERS_S
                self.replicate()
            except Exception:  # noqa: BLE001 - replication is best effort; never end the thread
                log.exception("snapshot replication failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)  # a send stalled on a cut-off peer must not hold up the agent's exit
        self.server.close()
