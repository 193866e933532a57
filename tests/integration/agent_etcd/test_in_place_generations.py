"""The process-group generations of pause in place, on a real etcd: a survivor waits for the agent's bump, and gives up
(to a restart of every worker) when a node of the job leaves (unless its place is held for a new node), when it is
stopped, or after its timeout."""

from __future__ import annotations

import threading
import time

import pytest

from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.settings import EtcdSettings
from elastictrain.runtime.inplace import InPlace, InPlaceFailed, InPlaceSettings, generations_store, next_generation


@pytest.fixture
def agent_side(etcd, run_id):
    settings = EtcdSettings.from_conf(etcd.endpoint, run_id, {})
    client = EtcdClient(settings)
    client.connect()
    client.put(f"{settings.run_prefix}/nodes/a", b"{}")
    client.put(f"{settings.run_prefix}/nodes/b", b"{}")
    yield client, settings.run_prefix
    client.delete_prefix(f"{settings.run_prefix}/")
    client.close()


def _survivor(etcd, run_id, timeout_s: float = 30.0, rejoin_s: float = 0.0) -> InPlace:
    worker = InPlace(InPlaceSettings(etcd.endpoint, run_id, {}, timeout_s, rejoin_s), rank=0, world_size=2)
    worker.generation = worker.read_generation()
    return worker


def _later(seconds: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), fn()), daemon=True)
    t.start()
    return t


def test_a_survivor_joins_the_generation_the_replacing_agent_starts(etcd, run_id, agent_side):
    client, prefix = agent_side
    worker = _survivor(etcd, run_id)
    assert worker.generation == 0
    beats: list[float] = []
    _later(0.3, lambda: next_generation(generations_store(client, prefix)))
    try:
        assert worker.wait_next(beat=lambda: beats.append(time.monotonic()), stop=lambda: False) == 1
        assert beats, "the survivor keeps beating (phase paused) while it waits"
    finally:
        worker.close()


def test_a_node_that_leaves_while_survivors_wait_ends_the_wait_at_once(etcd, run_id, agent_side):
    client, prefix = agent_side
    worker = _survivor(etcd, run_id)
    _later(0.3, lambda: client.delete(f"{prefix}/nodes/b"))  # its lease expired: no agent will replace its ranks
    started = time.monotonic()
    try:
        with pytest.raises(InPlaceFailed, match="node\\(s\\) b left the job"):
            worker.wait_next(beat=lambda: None, stop=lambda: False)
        assert time.monotonic() - started < 20, "it gave up on the node's departure, not on the timeout"
    finally:
        worker.close()


def test_with_its_place_held_a_node_that_leaves_is_waited_for_until_its_replacement_starts_a_generation(
        etcd, run_id, agent_side):
    """`elastic.rejoin_wait_s`: the lost node's place is held for a new node (rendezvous/vacancy.py), so the survivor
    keeps waiting, past its own timeout, and joins the generation the new node's agent starts."""
    client, prefix = agent_side
    worker = _survivor(etcd, run_id, timeout_s=0.5, rejoin_s=30)
    _later(0.3, lambda: client.delete(f"{prefix}/nodes/b"))
    _later(2.0, lambda: (client.put(f"{prefix}/nodes/c", b"{}"), next_generation(generations_store(client, prefix))))
    try:
        assert worker.wait_next(beat=lambda: None, stop=lambda: False) == 1
    finally:
        worker.close()


def test_a_node_gone_before_the_wait_began_is_still_seen_lost(etcd, run_id, agent_side):
    """A peer's presence link revokes a dead node's lease within milliseconds, often before this worker's collective
    with it fails: the node is gone when the wait begins. It still counts as lost (against the nodes as the
    generation started), so a held place is waited for past the worker's own timeout, as when the lease expires
    during the wait (before: no node counted as lost, and the timeout fell back to a restart of every worker)."""
    client, prefix = agent_side
    worker = _survivor(etcd, run_id, timeout_s=0.5, rejoin_s=30)
    client.delete(f"{prefix}/nodes/b")  # gone before the survivor paused
    _later(2.0, lambda: (client.put(f"{prefix}/nodes/c", b"{}"), next_generation(generations_store(client, prefix))))
    try:
        assert worker.wait_next(beat=lambda: None, stop=lambda: False) == 1
    finally:
        worker.close()


def test_a_stop_or_the_timeout_ends_the_wait(etcd, run_id, agent_side):
    worker = _survivor(etcd, run_id, timeout_s=0.5)
    try:
        with pytest.raises(InPlaceFailed, match="stopped while paused"):
            worker.wait_next(beat=lambda: None, stop=lambda: True)
        with pytest.raises(InPlaceFailed, match="elastic.in_place_timeout_s"):
            worker.wait_next(beat=lambda: None, stop=lambda: False)
    finally:
        worker.close()


def test_a_survivor_stuck_in_a_collective_after_a_replacement_exits_for_a_restart_and_a_paused_one_does_not(
        etcd, run_id, agent_side):
    from elastictrain.runtime.exitcodes import EXIT_NO_IN_PLACE
    from elastictrain.runtime.inplace import StuckWatch

    client, prefix = agent_side
    stuck, paused = _survivor(etcd, run_id), _survivor(etcd, run_id)
    exits: dict[str, int] = {}
    watches = [StuckWatch(w, pausing=lambda p=p: p, grace=lambda: 0.5, exit=lambda code, n=n: exits.setdefault(n, code))
               for w, p, n in ((stuck, False, "stuck"), (paused, True, "paused"))]
    for watch in watches:
        watch.start()
    try:
        next_generation(generations_store(client, prefix))
        deadline = time.monotonic() + 20
        while "stuck" not in exits and time.monotonic() < deadline:
            time.sleep(0.1)
        assert exits == {"stuck": EXIT_NO_IN_PLACE}, "a stuck survivor must leave; one that paused must not"
    finally:
        for watch in watches:
            watch.stop()
        stuck.close()
        paused.close()


def test_with_shrink_a_node_that_leaves_is_waited_for_until_the_agents_record_a_smaller_world(etcd, run_id,
                                                                                           agent_side):
    """`elastic.in_place_shrink`: a node that leaves does not end the wait; the survivors' agents drop it from the
    round (rendezvous/shrink.py) and the survivor reads its new place in the smaller world."""
    from elastictrain.rendezvous.shrink import Shrinks

    client, prefix = agent_side
    worker = InPlace(InPlaceSettings(etcd.endpoint, run_id, {}, 30.0, 0.0, shrink=True), rank=1, world_size=3)
    worker.round, worker.round_rank = 4, 2
    worker.generation = worker.read_generation()
    client.delete(f"{prefix}/nodes/b")
    _later(1.0, lambda: Shrinks(client, prefix).record(4, "b", {"a": [0], "b": [1], "c": [2]}))
    try:
        generation = worker.wait_next(beat=lambda: None, stop=lambda: False)
        world = worker.world_at(generation)
        assert world is not None and world.size == 2 and world.rank_of(worker.round_rank) == 1, world
        assert worker.world_at(generation - 1) is None, "the generation before the shrink ran the full world"
    finally:
        worker.close()


def test_a_survivor_does_not_take_a_shrinks_generation_before_its_world_is_recorded(etcd, run_id, agent_side):
    """A shrink moves the generation counter, then writes the smaller world's record. A survivor that read the counter
    in between took the old world for the new generation's and joined a group that waited for the lost rank: both
    survivors hung (the 3-node chaos test, about one run in four). The wait now ends only once the record is there."""
    from elastictrain.rendezvous.shrink import Shrinks

    client, prefix = agent_side
    worker = InPlace(InPlaceSettings(etcd.endpoint, run_id, {}, 30.0, 0.0, shrink=True), rank=0, world_size=3)
    worker.round, worker.round_rank = 4, 0
    worker.generation = worker.read_generation()
    shrinks = Shrinks(client, prefix)
    # The recording agent's first steps, then a pause before it writes the world: what the survivor can read then.
    client.cas(f"{prefix}/inplace/shrink/4/gone/b", b"1", None)
    store = generations_store(client, prefix)
    store.add("gen", 1)
    assert not worker.recorded(worker.read_generation()), "a generation whose world is not written counted as recorded"

    def finish() -> None:
        gen = worker.read_generation()
        client.put(f"{prefix}/inplace/shrink/4/world/{gen}", b'{"survivors": [0, 2], "gone": ["b"], "joined": []}')

    _later(1.0, finish)
    try:
        started = time.monotonic()
        generation = worker.wait_next(beat=lambda: None, stop=lambda: False)
        assert time.monotonic() - started >= 0.9, "the wait ended before the smaller world was recorded"
        world = worker.world_at(generation)
        assert world is not None and world.size == 2 and world.gone == ("b",), world
        assert shrinks.world(4, generation) == world
    finally:
        worker.close()
