"""Peer replicas between real replica servers on loopback (checkpoint/replica_wire.py, replica_server.py,
replica_fetch.py): a replica is committed only with the bytes its checksum names, a slot rewritten while being sent
is never committed, a server answers only requests with its token, and a rank whose node lost its snapshot restores
bitwise from a peer's copy, or says why it cannot."""

from __future__ import annotations

import os
import time

import pytest
import torch

from elastictrain.checkpoint.replica_server import ReplicaServer
from elastictrain.checkpoint.replica_wire import (
    REPLICAS_DIR,
    Peer,
    PeerList,
    SlotReader,
    WordSum,
    committed_markers,
    fetch,
    held,
    push,
)
from elastictrain.checkpoint.snapshot import SnapshotStore, _checksum
from elastictrain.config import CheckpointConfig
from elastictrain.errors import SnapshotReplicaError
from elastictrain.runtime.checkpointing import StateCheckpointer
from elastictrain.runtime.heartbeat import Heartbeat
from tests.unit.checkpoint.test_snapshot import JOB, _same, _state, _train


@pytest.fixture
def server(tmp_path):
    s = ReplicaServer(tmp_path / "b", "127.0.0.1", "node-b", "token-b")
    yield s
    s.close()


def _saves(store: SnapshotStore, steps: int):
    """A trained state snapshotted after each of `steps` steps; returns it and the commit infos."""
    state, model, optim = _state(0)
    infos = []
    for _ in range(steps):
        _train(state, model, optim)
        infos.append(store.save(state.step, state.checkpoint_state(0)))
    return state, infos


def _replicas(server: ReplicaServer, source: str, rank: int) -> list[int]:
    return [m["step"] for m in committed_markers(server.folder / REPLICAS_DIR / source / f"rank{rank}")]


def test_a_pushed_snapshot_is_committed_on_the_peer_and_restores_bitwise(tmp_path, server):
    store = SnapshotStore(tmp_path / "a", 1, JOB)
    state, (info,) = _saves(store, 1)
    assert push(server.peer(), "node-a", 1, SlotReader.open(store.dir, info.slot), 10) == info.checksum
    replica = SnapshotStore(server.folder / REPLICAS_DIR / "node-a", 1, JOB)
    (got,), why = replica.available()
    assert got == info and not why
    fresh, _, _ = _state(7)
    replica.restore(got, fresh.checkpoint_state(0))
    assert _same(fresh, state)


def test_a_replica_whose_bytes_do_not_match_their_checksum_is_refused_and_the_other_slot_stays(tmp_path, server):
    store = SnapshotStore(tmp_path / "a", 1, JOB)
    state, model, optim = _state(0)
    for _ in range(3):
        _train(state, model, optim)
        info = store.save(state.step, state.checkpoint_state(0))
        if state.step == 3:  # step 3's bytes, changed after their commit
            with open(store.dir / f"slot{info.slot}.bin", "r+b") as f:
                f.seek(3)
                f.write(b"\x55")
            with pytest.raises(SnapshotReplicaError, match="do not match"):
                push(server.peer(), "node-a", 1, SlotReader.open(store.dir, info.slot), 10)
        else:
            push(server.peer(), "node-a", 1, SlotReader.open(store.dir, info.slot), 10)
            assert _replicas(server, "node-a", 1)[0] == state.step
    assert _replicas(server, "node-a", 1) == [2], "the slot being replaced is uncommitted, the other one stays"


def test_a_slot_rewritten_while_being_sent_is_not_committed(tmp_path, server):
    store = SnapshotStore(tmp_path / "a", 1, JOB)
    state, model, optim = _state(0)
    _train(state, model, optim)
    first = store.save(state.step, state.checkpoint_state(0))
    reader = SlotReader.open(store.dir, first.slot)  # the sender read the marker and the layout ...
    for _ in range(2):  # ... then the worker saved twice: the second save rewrote that slot
        _train(state, model, optim)
        store.save(state.step, state.checkpoint_state(0))
    assert push(server.peer(), "node-a", 1, reader, 10) is None
    assert _replicas(server, "node-a", 1) == []


def test_a_server_answers_only_its_token_and_only_from_its_folder(tmp_path, server):
    store = SnapshotStore(tmp_path / "a", 0, JOB)
    _, (info,) = _saves(store, 1)
    stranger = Peer("node-b", *server.address, token="guessed")
    with pytest.raises(SnapshotReplicaError, match="403"):
        held(stranger, 0, 5)
    with pytest.raises(SnapshotReplicaError):
        push(stranger, "node-a", 0, SlotReader.open(store.dir, info.slot), 10)
    assert not (server.folder / REPLICAS_DIR).exists()
    with pytest.raises(SnapshotReplicaError, match="404"):
        fetch(server.peer(), "../a/rank0", info.slot, tmp_path / "c" / "rank0", 0, 5)


def test_the_listing_offers_the_nodes_own_snapshot_and_the_newest_sources_replica(tmp_path, server):
    """After a re-form a rank may find its snapshot among a node's own ranks (the ranks moved) or its replicas; a
    replica of a rank replaces another node's replica of it (that node's ranks went elsewhere)."""
    SnapshotStore(server.folder, 1, JOB).save(5, {"x": torch.ones(3)})
    for source, step in (("node-a", 4), ("node-c", 6)):
        info = SnapshotStore(tmp_path / source, 1, JOB).save(step, {"x": torch.ones(3)})
        push(server.peer(), source, 1, SlotReader.open(tmp_path / source / "rank1", info.slot), 10)
    listed = [(path, marker["step"]) for path, marker in held(server.peer(), 1, 5)]
    assert listed == [("rank1", 5), (f"{REPLICAS_DIR}/node-c/rank1", 6)]
    assert not (server.folder / REPLICAS_DIR / "node-a").exists()


def test_a_peer_that_is_down_is_reported_unreachable(tmp_path, server):
    store = SnapshotStore(tmp_path / "a", 0, JOB)
    _, (info,) = _saves(store, 1)
    peer = server.peer()
    server.close()
    with pytest.raises(SnapshotReplicaError, match="node-b .*refused"):
        push(peer, "node-a", 0, SlotReader.open(store.dir, info.slot), 5)


def test_the_checksum_computed_chunk_by_chunk_is_the_snapshots():
    for size in (0, 7, 8, 4 << 20, (4 << 20) + 13):
        data = bytearray(os.urandom(size))
        summed = WordSum()
        for at in range(0, size, 1 << 20):
            summed.update(memoryview(data)[at:at + (1 << 20)])
        whole = torch.frombuffer(data, dtype=torch.uint8) if size else torch.zeros(0, dtype=torch.uint8)
        assert summed.value == _checksum(whole)


def _checkpointer(tmp_path, monkeypatch, folder: str, world_size: int = 1) -> StateCheckpointer:
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT_DIR", str(tmp_path / folder))
    state, _, _ = _state(7)
    return StateCheckpointer(CheckpointConfig(url=str(tmp_path / "ck"), snapshot_every_steps=1, storage_wait_s=0),
                             state, Heartbeat(None), rank=0, world_size=world_size, fingerprint={"model": "m"})


def _lost_node_snapshot(tmp_path, monkeypatch, server, identity_world_size: int = 1):
    """Rank 0's snapshot of step 2, written on a node that is gone since, and replicated to `server` before."""
    lost = _checkpointer(tmp_path, monkeypatch, "lost")
    store = SnapshotStore(tmp_path / "lost", 0, {**lost.snapshots.identity, "world_size": identity_world_size})
    lost.close()
    state, infos = _saves(store, 2)
    for info in infos:
        push(server.peer(), "node-lost", 0, SlotReader.open(store.dir, info.slot), 10)
    new = tmp_path / "new"
    new.mkdir()
    PeerList("node-new", [server.peer()]).write(new)  # what the re-started node's agent writes
    return state


def test_a_rank_whose_node_lost_its_snapshot_restores_bitwise_from_a_peers_replica(tmp_path, monkeypatch, server):
    state = _lost_node_snapshot(tmp_path, monkeypatch, server)
    ckpt = _checkpointer(tmp_path, monkeypatch, "new")
    events = []
    ckpt._emit = lambda name, fields: events.append((name, fields))
    try:
        resumed = ckpt.restore()
        assert resumed is not None and resumed.source == "snapshot:step-2" and not resumed.reseed
        assert _same(ckpt.state, state)
        assert ("checkpoint_snapshot_loaded", {"step": 2, "durable_step": None, "fetched_ranks": 1,
                                               "from_nodes": ["node-b"]}) in events
        assert [i.step for i in ckpt.snapshots.available()[0]] == [2], "the copy is this rank's snapshot now"
    finally:
        ckpt.close()


def test_a_replica_of_another_world_size_is_not_loaded_and_the_skip_event_says_why(tmp_path, monkeypatch, server):
    """Rank 0's slot of a 2-rank snapshot, on a node outside the group: not this rank's shard at world size 1, and no
    node of the group holds rank 1's to reshard from (tests/integration/checkpoint/test_snapshot_reshard.py)."""
    _lost_node_snapshot(tmp_path, monkeypatch, server, identity_world_size=2)
    ckpt = _checkpointer(tmp_path, monkeypatch, "new")
    events = []
    ckpt._emit = lambda name, fields: events.append((name, fields))
    try:
        assert ckpt.restore() is None  # nothing durable either: a fresh start
        (skipped,) = [f for name, f in events if name == "checkpoint_snapshot_skipped"]
        assert "on node-b was taken at world size 2" in skipped["reason"], skipped
        assert ckpt.state.step == 0
    finally:
        ckpt.close()


def test_a_bandwidth_cap_spreads_the_replica_over_time_and_it_still_commits_bitwise(tmp_path, server):
    """elastic.replica_bandwidth: on a CPU node the replica's copy competes with training, so it can be paced. The
    lower bound on the time is what the cap promises (a loaded machine only makes it slower)."""
    import time

    from elastictrain.config import ElasticConfig, replica_rate
    from elastictrain.errors import ConfigError

    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)  # ~1 MB of parameters (+2 MB of Adam state after a step)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    optim.step()
    store = SnapshotStore(tmp_path / "a", 0, JOB)
    info = store.save(1, {"model": model.state_dict(), "optim": optim.state_dict()})
    rate = info.nbytes * 2  # half a second's worth
    started = time.monotonic()
    assert push(server.peer(), "node-a", 0, SlotReader.open(store.dir, info.slot), 10, rate=rate) == info.checksum
    assert time.monotonic() - started >= 0.45, "the replica went faster than the cap"
    assert _replicas(server, "node-a", 0) == [1]
    assert replica_rate(ElasticConfig(replica_bandwidth="200MB")) == 200_000_000
    assert replica_rate(ElasticConfig()) is None
    with pytest.raises(ConfigError, match="elastic.replica_bandwidth"):
        replica_rate(ElasticConfig(replica_bandwidth="0.5"))


def test_a_replica_push_gives_way_to_a_restore_copying_from_this_node_and_commits_nothing_half_sent(
        tmp_path, server, monkeypatch):
    """A restoring worker's copy of a slot from this node's agent (a grow in place, a restart) is on the job's
    critical path; this node's replica push to the same peer is not (seen at 150M: both 1-2 GB copies at once). The
    agent's server counts the copies it serves, and a push stops between pieces while one runs: the peer drops the
    part it got, and the push is made again later, whole."""
    from elastictrain.checkpoint import replica_wire

    store = SnapshotStore(tmp_path / "a", 1, JOB)
    _, (info,) = _saves(store, 1)
    monkeypatch.setattr(replica_wire, "GIVE_WAY_PIECE", max(1, info.nbytes // 8))
    asked = []

    def restore_begins() -> bool:
        asked.append(1)
        return len(asked) > 2  # two pieces sent, then a restore starts copying
    assert push(server.peer(), "node-a", 1, SlotReader.open(store.dir, info.slot), 10,
                give_way=restore_begins) is None
    assert len(asked) == 3 and _replicas(server, "node-a", 1) == [], "a half-sent replica was committed"
    assert push(server.peer(), "node-a", 1, SlotReader.open(store.dir, info.slot), 10,
                give_way=lambda: False) == info.checksum
    assert _replicas(server, "node-a", 1) == [info.step]

    seen = []
    send = SlotReader.send

    def counting(self, *a, **k):
        seen.append(server.serving)
        return send(self, *a, **k)
    monkeypatch.setattr(SlotReader, "send", counting)
    fetch(server.peer(), f"{REPLICAS_DIR}/node-a/rank1", info.slot, tmp_path / "c" / "rank1", 0, 5)
    # The client may have all the bytes before the server's thread is done with the request (CI: serving was still 1).
    deadline = time.monotonic() + 5
    while server.serving and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [1] and server.serving == 0, "the server counts the copy it serves while it serves it"


def test_receiving_a_replica_leaves_the_agents_other_threads_running():
    """The replica server runs in the agent, beside the thread that keeps the node's etcd lease alive (2 s TTL in the
    benchmarks). Mapping a received slot with MAP_POPULATE held the GIL while the kernel populated every page: 0.4 s
    per GB on an idle machine, 2.4 s while a new node started beside a re-forming survivor, and that node's lease
    lapsed (a restart of every worker). Here a 1 GiB replica streams in while another thread ticks every 5 ms: no
    tick may wait more than 0.25 s (with MAP_POPULATE: 0.37-0.39 s on an idle machine)."""
    import shutil
    import socket
    import tempfile
    import threading
    from pathlib import Path

    from elastictrain.checkpoint.replica_wire import receive_slot

    nbytes = 1 << 30
    if shutil.disk_usage("/dev/shm").free < 2 * nbytes:
        pytest.skip("needs 2 GiB free in /dev/shm")
    piece = bytes(4 << 20)
    ours, theirs = socket.socketpair()

    def send() -> None:
        with theirs:
            for _ in range(nbytes // len(piece)):
                theirs.sendall(piece)
            theirs.sendall(b"{}")

    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick, daemon=True)
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="elastictrain-test-") as folder, ours:
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        ticker.start()
        marker = {"step": 1, "nbytes": nbytes, "checksum": 0}  # zeros sum to zero
        assert receive_slot(ours.recv_into, Path(folder) / "rank0", 0, marker, 2) == 0
        done.set()
        ticker.join()
        sender.join()
    assert max(gaps) < 0.25, f"a tick waited {max(gaps):.2f} s while the replica was received: the GIL was held"
