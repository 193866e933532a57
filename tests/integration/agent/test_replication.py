"""Peer replicas between agents' Replicators (agent/replication.py) on loopback, found through a real etcd: each
node's snapshots reach the next node of the ring, a restarting rank finds them there through `peers.json`, a peer
that is down leaves the snapshots local-only with one warning event, and the ring follows the nodes' leases."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import pytest

from elastictrain.agent import replication
from elastictrain.agent.replication import Replicator
from elastictrain.checkpoint.replica_fetch import fetch_offer, find_offers
from elastictrain.checkpoint.replica_wire import REPLICAS_DIR, PeerList, committed_markers
from elastictrain.checkpoint.snapshot import SnapshotStore
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.liveness import NodeLiveness
from elastictrain.rendezvous.settings import EtcdSettings
from tests.unit.checkpoint.test_snapshot import JOB, _same, _state, _train

pytestmark = pytest.mark.timeout(120)


class _Node:
    """One agent's share of replication: its etcd lease-bound record, its snapshot folder, its Replicator."""

    def __init__(self, name: str, tmp: Path, endpoint: str, run_id: str):
        self.restoring = False
        """What the agent's heartbeat view says: a local worker is paused in place or loading its state."""
        settings = EtcdSettings.from_conf(endpoint, run_id, {})
        self.client = EtcdClient(settings)
        self.client.connect()
        self.folder = tmp / name
        self.folder.mkdir()
        self.liveness = NodeLiveness(self.client, f"{settings.run_prefix}/nodes", f"node-{name}", ttl=2)
        self.liveness.start()
        self.events: list[tuple[str, dict]] = []
        self.replicator = Replicator(self.folder, self.client, settings.run_prefix, self.liveness, "127.0.0.1",
                                     lambda kind, fields: self.events.append((kind, fields)), poll_s=0.02,
                                     restoring=lambda: self.restoring)

    def kinds(self, kind: str) -> list[dict]:
        return [f for k, f in self.events if k == kind]

    def replicas(self, source: str, rank: int) -> list[int]:
        return [m["step"] for m in committed_markers(self.folder / REPLICAS_DIR / f"node-{source}" / f"rank{rank}")]

    def stop(self) -> None:
        """Safe to call twice."""
        self.replicator.close()
        self.liveness.stop()
        self.client.close()


@pytest.fixture
def make_node(tmp_path, etcd, run_id):
    made: list[_Node] = []

    def make(name: str) -> _Node:
        made.append(_Node(name, tmp_path, etcd.endpoint, run_id))
        return made[-1]

    yield make
    for node in made:
        node.stop()


def _wait(what: str, predicate: Callable[[], bool], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.02)


def _ring(*nodes: _Node) -> None:
    """Until every node knows every other (each re-reads the ring every MEMBERS_S)."""
    _wait("every node sees the ring", lambda: all(len(n.replicator._peers or []) == len(nodes) for n in nodes))


def test_each_nodes_snapshots_reach_its_ring_peer_and_a_restarting_rank_finds_them_there(make_node):
    a, b = make_node("a"), make_node("b")
    _ring(a, b)
    assert [p.node for p in PeerList.read(a.folder).peers] == ["node-a", "node-b"]
    state, model, optim = _state(0)
    store_a, store_b = SnapshotStore(a.folder, 0, JOB), SnapshotStore(b.folder, 1, JOB)
    for _ in range(3):
        _train(state, model, optim)
        store_a.save(state.step, state.checkpoint_state(0))
        store_b.save(state.step, {"x": state.step})
    _wait("both nodes hold the other's step 3", lambda: b.replicas("a", 0)[:1] == [3] and a.replicas("b", 1)[:1] == [3])
    (announced,) = a.kinds("checkpoint_snapshot_replicated")  # the first replica on a peer, not every step
    assert announced["peer"] == "node-b" and announced["rank"] == 0
    assert not a.kinds("checkpoint_snapshot_replica_failed") and not b.kinds("checkpoint_snapshot_replica_failed")

    # Node a is lost, its rank 0 restarts on b (the ranks moved at the re-form): b's agent holds a's replica.
    offers, why = find_offers(b.folder, 0, JOB)
    assert 3 in offers and offers[3].peer.node == "node-b" and not why
    fetch_offer(offers[3], b.folder / "rank0")
    restored, _, _ = _state(9)
    mine = SnapshotStore(b.folder, 0, JOB)
    mine.restore(next(i for i in mine.available()[0] if i.step == 3), restored.checkpoint_state(0))
    assert _same(restored, state)


def test_a_peer_that_is_down_leaves_the_snapshots_local_only_with_one_warning_event(make_node):
    a, b = make_node("a"), make_node("b")
    _ring(a, b)
    store = SnapshotStore(a.folder, 0, JOB)
    store.save(1, {"x": 1})
    _wait("step 1 replicated", lambda: b.replicas("a", 0) == [1])
    b.replicator.server.close()  # b's agent no longer answers; its lease is still alive
    for step in range(2, 6):
        store.save(step, {"x": step})
        time.sleep(0.3)  # a retries with backoff meanwhile
    assert [i.step for i in store.available()[0]] == [5, 4], "snapshots go on, local-only"
    (failed,) = a.kinds("checkpoint_snapshot_replica_failed")
    assert failed["peer"] == "node-b" and "refused" in failed["error"], failed
    b.liveness.stop()  # b's lease goes: a is alone in the ring
    _wait("a sees it is alone", lambda: a.replicator.peer is None)
    assert len(a.kinds("checkpoint_snapshot_replica_failed")) == 1


def test_no_replica_goes_out_while_a_local_worker_restores_but_not_for_longer_than_the_hold(make_node, monkeypatch):
    """A re-form in place moves the snapshot over the process group while the workers are paused and load: the
    replica (the whole slot, on the same link and cores) waits for them, then the newest snapshot goes at once. A
    pause that lasts (an operator's) holds the replicas no longer than `RESTORE_HOLD_MAX_S`."""
    monkeypatch.setattr(replication, "RESTORE_HOLD_MAX_S", 2.0)
    a, b = make_node("a"), make_node("b")
    _ring(a, b)
    store = SnapshotStore(a.folder, 0, JOB)
    store.save(1, {"x": 1})
    _wait("step 1 replicated", lambda: b.replicas("a", 0) == [1])
    a.restoring = True
    store.save(2, {"x": 2})
    time.sleep(1.0)  # 50 polls
    assert b.replicas("a", 0) == [1], "a replica went out while a local worker was restoring"
    a.restoring = False
    _wait("step 2 replicated once the workers train", lambda: b.replicas("a", 0)[:1] == [2], timeout=5)
    assert not a.kinds("checkpoint_snapshot_replica_failed"), "waiting for a restore is no failure"
    a.restoring = True
    store.save(3, {"x": 3})
    time.sleep(1.0)
    assert b.replicas("a", 0)[:1] == [2], "a replica went out while a local worker was restoring"
    _wait("step 3 replicated after the hold, the workers still paused", lambda: b.replicas("a", 0)[:1] == [3],
          timeout=5)


def test_a_rank_restarted_on_a_new_node_does_not_send_back_the_snapshot_it_copied_from_its_peer(make_node):
    """Node x is lost; its rank restarts on a new node y and copies its snapshot from a, which held x's replica. y
    does not send those bytes back to a (at 150M, 1.2 GB on the cores the first step after the restore trains on):
    a holds them, so the snapshot counts as replicated; y's next snapshot goes to a as usual."""
    a, x = make_node("a"), make_node("x")
    _ring(a, x)
    store_x = SnapshotStore(x.folder, 1, JOB)
    store_x.save(3, {"x": 3})
    _wait("x's step 3 on a", lambda: a.replicas("x", 1) == [3])
    x.stop()  # node x is lost
    y = make_node("y")
    _ring(a, y)
    offers, why = find_offers(y.folder, 1, JOB)
    assert 3 in offers and offers[3].peer.node == "node-a", why
    fetch_offer(offers[3], y.folder / "rank1")  # what the restarted rank does before it loads
    _wait("y counts step 3 as replicated on a", lambda: y.replicator.replicated() == (3, "node-a"), timeout=5)
    time.sleep(0.5)  # 25 polls
    assert a.replicas("y", 1) == [], \
        "the copied snapshot was sent back to the node it came from"
    SnapshotStore(y.folder, 1, JOB).save(4, {"x": 4})
    _wait("y's step 4 on a", lambda: a.replicas("y", 1)[:1] == [4])
    assert a.replicas("x", 1) == [], "a keeps only the newest sender's replica of rank 1"
    assert not y.kinds("checkpoint_snapshot_replica_failed")


def test_the_ring_closes_over_a_lost_node(make_node):
    a, b, c = make_node("a"), make_node("b"), make_node("c")
    _ring(a, b, c)
    assert (a.replicator.peer.node, b.replicator.peer.node, c.replicator.peer.node) == ("node-b", "node-c", "node-a")
    store = SnapshotStore(a.folder, 0, JOB)
    store.save(1, {"x": 1})
    _wait("a's step 1 on b", lambda: b.replicas("a", 0) == [1])
    b.stop()
    _wait("a's peer is c", lambda: a.replicator.peer is not None and a.replicator.peer.node == "node-c")
    store.save(2, {"x": 2})
    _wait("a's step 2 on c", lambda: c.replicas("a", 0)[:1] == [2])
    assert [f["peer"] for f in a.kinds("checkpoint_snapshot_replicated")] == ["node-b", "node-c"]
