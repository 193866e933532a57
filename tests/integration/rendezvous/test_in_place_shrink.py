"""A smaller world in place (`--rdzv-conf in_place_shrink=1`, rendezvous/shrink.py), with the real handler on a real
etcd: a lost member is dropped from the running round without a new round while `min_nodes` are left, its loss
recorded once whoever sees it, and the recorded world names the surviving ranks in order; below `min_nodes`, or with
a node waiting to join, the survivors ask for a new round as before."""

from __future__ import annotations

import json
import threading
import time

from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.etcd_handler import EtcdRendezvousHandler, create_etcd_handler
from elastictrain.rendezvous.settings import EtcdSettings
from elastictrain.rendezvous.shrink import Shrinks, round_ranks
from tests.fixtures.etcd import EtcdHandle
from tests.integration.rendezvous.test_handler import _kill_without_goodbye, _params, _rendezvous_all


def _form(etcd: EtcdHandle, run_id: str, n: int, sizes: list[int], min_nodes: int = 1,
          shrink: int = 1) -> list[EtcdRendezvousHandler]:
    """`n` nodes in one round, ordered by group rank, node i running `sizes[i]` workers (as torch's agent records
    it in the round's store)."""
    handlers = [create_etcd_handler(_params(etcd.endpoint, run_id, min_nodes, n, in_place_shrink=shrink))
                for _ in range(n)]
    for h in handlers:  # what a survivor's agent sees when a peer dies: its workers' collectives fail, they pause
        h.workers_paused = lambda: True
    infos = _rendezvous_all(handlers)
    by_rank = sorted(zip(handlers, infos), key=lambda hi: hi[1].rank)
    for (_, info), size in zip(by_rank, sizes):
        info.store.set(f"torchelastic/role_info/{info.rank}", json.dumps({"role": "default", "rank": info.rank,
                                                                          "local_world_size": size}))
    return [h for h, _ in by_rank]


def _shrinks(etcd: EtcdHandle, run_id: str) -> Shrinks:
    settings = EtcdSettings.from_conf(etcd.endpoint, run_id, {})
    client = EtcdClient(settings)
    client.connect()
    return Shrinks(client, settings.run_prefix)


def _until_dropped(handler: EtcdRendezvousHandler, timeout: float = 15) -> None:
    start = time.monotonic()
    while not handler.shrunk:
        assert handler.num_nodes_waiting() == 0, "the survivor asked for a new round instead of shrinking in place"
        assert time.monotonic() - start < timeout, "the lost node was never dropped"
        time.sleep(0.1)


def _until_grown(survivor: EtcdRendezvousHandler, timeout: float = 10) -> None:
    start = time.monotonic()
    while not survivor.grown:
        assert survivor.num_nodes_waiting() == 0, "a survivor asked for a new round instead of growing in place"
        assert time.monotonic() - start < timeout, "a survivor never saw the node that took the place back"
        time.sleep(0.1)


def _take_place(etcd: EtcdHandle, run_id: str, lost: EtcdRendezvousHandler, rank: int, why: str,
                max_nodes: int = 3, **conf: object) -> EtcdRendezvousHandler:
    """A node started after `lost` was dropped: it must take `lost`'s place (group rank `rank` of 2) in place."""
    new = create_etcd_handler(_params(etcd.endpoint, run_id, 1, max_nodes, **conf))
    place = new.claim_vacancy(1, wait_s=2)
    assert place is not None and place.lost == lost.this_node, why
    info = new.next_rendezvous()
    assert (info.rank, info.world_size) == (rank, 2), (info.rank, info.world_size)
    return new


def test_round_ranks_follow_torchs_numbering_of_unequal_nodes() -> None:
    assert round_ranks({"a": 0, "b": 1, "c": 2}, {0: 2, 1: 1, 2: 3}) == {"a": [0, 1], "b": [2], "c": [3, 4, 5]}
    # A member that already left keeps its ranks' places in the numbering.
    assert round_ranks({"a": 0, "c": 2}, {0: 2, 1: 1, 2: 3}) == {"a": [0, 1], "c": [3, 4, 5]}


def test_a_lost_middle_node_is_dropped_in_place_and_its_ranks_leave_the_world(etcd: EtcdHandle, run_id: str) -> None:
    first, middle, last = _form(etcd, run_id, 3, [2, 1, 2])
    shrinks = _shrinks(etcd, run_id)
    rnd = first._round[0]
    _kill_without_goodbye(middle)
    # Both survivors see the loss; one records it, neither asks for a new round.
    worlds: list = []

    def watch(h: EtcdRendezvousHandler) -> None:
        _until_dropped(h)
        worlds.extend(w for _, w in h.shrunk)

    threads = [threading.Thread(target=watch, args=(h,)) for h in (first, last)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    recorded = [w for w in worlds if w is not None]
    assert len(recorded) == 1, f"the loss was recorded {len(recorded)} times: {worlds}"
    world = recorded[0]
    assert world.survivors == (0, 1, 3, 4) and world.gone == (middle.this_node,), world
    assert [world.rank_of(r) for r in (0, 1, 3, 4)] == [0, 1, 2, 3] and world.rank_of(2) is None
    assert shrinks.world(rnd, world.generation) == world == last.world(world.generation)
    assert shrinks.world(rnd, world.generation - 1) is None, "an older generation ran the full world"
    assert first.num_nodes_waiting() == 0 and last.num_nodes_waiting() == 0, "the dropped node was reported later"
    for h in (first, last):
        h.shutdown()


def test_two_losses_leave_a_newest_world_without_either(etcd: EtcdHandle, run_id: str) -> None:
    """Two agents record two losses at once: whatever order their generations got, the newest names both."""
    nodes = _form(etcd, run_id, 4, [1, 1, 1, 1])
    shrinks = _shrinks(etcd, run_id)
    rnd = nodes[0]._round[0]
    ranks = nodes[0].round_ranks()
    assert ranks is not None
    out: list = []
    barrier = threading.Barrier(2)

    def record(lost: EtcdRendezvousHandler) -> None:
        barrier.wait()
        out.append(_shrinks(etcd, run_id).record(rnd, lost.this_node, ranks))

    threads = [threading.Thread(target=record, args=(h,)) for h in (nodes[1], nodes[3])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(w is not None for w in out), out
    newest = shrinks.world(rnd, max(w.generation for w in out))
    assert newest is not None and newest.survivors == (0, 2), newest
    assert shrinks.record(rnd, nodes[1].this_node, ranks) is None, "a loss was recorded twice"
    shrinks.forget_before(rnd + 1)
    assert shrinks.world(rnd, 1 << 40) is None, "a new round still saw the old round's shrinks"
    for h in nodes:
        h.shutdown()


def test_below_min_nodes_the_survivors_ask_for_a_new_round(etcd: EtcdHandle, run_id: str) -> None:
    lost, survivor = _form(etcd, run_id, 2, [1, 1], min_nodes=2)
    _kill_without_goodbye(lost)
    start = time.monotonic()
    while survivor.num_nodes_waiting() == 0:
        assert time.monotonic() - start < 15, "the survivor never reported the lost node"
        time.sleep(0.1)
    assert not survivor.shrunk, "a round of 2:2 was shrunk below min_nodes"
    survivor.shutdown()


def test_a_lost_lease_without_paused_workers_is_doubted_then_reported_not_dropped(etcd: EtcdHandle,
                                                                                 run_id: str) -> None:
    """A lease can lapse on a live node (its agent starved of CPU): while this node's workers train on (no pause),
    the loss is not acted on in place; it is reported (a new round, as without shrinking) only after the doubt."""
    lost, survivor = _form(etcd, run_id, 2, [1, 1])
    training = [True]
    survivor.workers_paused = lambda: not training[0]
    _kill_without_goodbye(lost)
    start = time.monotonic()
    while time.monotonic() - start < 3.5:  # the lease (2 s) expires, and the survivor still doubts
        assert survivor.num_nodes_waiting() == 0, "a lapsed lease was acted on at once"
        time.sleep(0.1)
    assert not survivor.shrunk, "a node whose peers' workers still train was dropped in place"
    while survivor.num_nodes_waiting() == 0:
        assert time.monotonic() - start < 15, "the doubted node was never reported"
        time.sleep(0.1)
    assert not survivor.shrunk
    survivor.shutdown()


def test_a_doubted_node_is_dropped_once_this_nodes_workers_pause(etcd: EtcdHandle, run_id: str) -> None:
    lost, survivor = _form(etcd, run_id, 2, [1, 1])
    training = [True]
    survivor.workers_paused = lambda: not training[0]
    _kill_without_goodbye(lost)
    start = time.monotonic()
    while not survivor._doubted:
        assert survivor.num_nodes_waiting() == 0 and time.monotonic() - start < 10, "the loss was never seen"
        time.sleep(0.1)
    training[0] = False  # the collective with it failed: the workers pause in place
    _until_dropped(survivor)
    assert [n for n, _ in survivor.shrunk] == [lost.this_node]
    survivor.shutdown()


def test_a_node_started_later_takes_a_dropped_nodes_place_back_in_place(etcd: EtcdHandle, run_id: str) -> None:
    """A grow: node b (rank 1 of 3) lost for good, the round goes on as a world of 2; node d started later takes b's
    open place in the running round (no new round: nobody waits to join), records a world of 3 again in a newer
    generation in which its worker has b's old rank, and the survivors count it as a member from then on. A node of
    another size, and a second node after it, find no place."""
    first, lost, last = _form(etcd, run_id, 3, [1, 1, 1])
    shrinks = _shrinks(etcd, run_id)
    rnd = first._round[0]
    _kill_without_goodbye(lost)
    _until_dropped(first)
    _until_dropped(last)
    shrunk = shrinks.world(rnd)
    assert shrunk is not None and shrunk.survivors == (0, 2), shrunk

    bigger = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3, in_place_shrink=1))
    assert bigger.claim_vacancy(2, wait_s=0) is None, "a node of 2 workers took the place of a node of 1"
    new = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3, in_place_shrink=1))
    place = new.claim_vacancy(1, wait_s=0)
    assert place is not None and place.lost == lost.this_node and place.group_rank == 1, place
    grown = new.grow_world
    assert grown is not None and grown.generation > shrunk.generation, grown
    assert grown.survivors == (0, 1, 2) and grown.joined == (1,) and grown.gone == (), grown
    info = new.next_rendezvous()
    assert (info.rank, info.world_size) == (1, 3), "the new node did not take the lost node's group rank"
    assert new.took_over is not None and new.took_over.lost == lost.this_node
    assert shrinks.gone(rnd) == set(), "the lost node is still recorded gone after its place was taken back"

    for survivor in (first, last):
        _until_grown(survivor)
        assert survivor.grown == [(lost.this_node, new.this_node)]
        assert survivor.world() == grown and survivor.members_left() == 3
        assert survivor.round_ranks() == {first.this_node: [0], new.this_node: [1], last.this_node: [2]}

    other = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3, in_place_shrink=1))
    assert other.claim_vacancy(1, wait_s=0) is None and other.grow_world is None, "a place was taken twice"
    for h in (first, last, new, other, bigger):
        h.shutdown()


def test_a_survivor_whose_torch_heartbeat_is_stale_still_runs_the_round_a_new_node_grows(etcd: EtcdHandle,
                                                                                          run_id: str) -> None:
    """The split seen once in a goodput run: node b lost for good, survivor a trains alone in the shrunk round, and
    a's heartbeat timestamp in torch's state goes stale (its timer thread late or stopped) while its etcd lease lives.
    torch's sanitizer then drops a from every fresh read of the state: the round looked over, and b started again
    formed a 1-node round of its own beside a. The lease decides liveness: b takes its place back in a's round."""
    conf = {"in_place_shrink": 1, "keep_alive_interval": 1, "keep_alive_max_attempt": 2}
    handlers = [create_etcd_handler(_params(etcd.endpoint, run_id, 1, 2, **conf)) for _ in range(2)]
    for h in handlers:
        h.workers_paused = lambda: True
    infos = _rendezvous_all(handlers)
    for info in infos:
        info.store.set(f"torchelastic/role_info/{info.rank}",
                       json.dumps({"role": "default", "rank": info.rank, "local_world_size": 1}))
    survivor, lost = sorted(handlers, key=lambda h: h._round[1][h.this_node])
    _kill_without_goodbye(lost)
    _until_dropped(survivor)
    survivor._stop_heartbeats()  # its lease lives on; its torch heartbeat does not
    time.sleep(3.0)  # past keep_alive_interval * keep_alive_max_attempt

    new = _take_place(etcd, run_id, lost, 1, "the new node found no running round while the survivor's lease lived: "
                      "it would form a round of its own", max_nodes=2, **conf)
    assert survivor.num_nodes_waiting() == 0
    for h in (survivor, new):
        h.shutdown()


def test_a_node_that_grew_the_round_keeps_it_running_after_every_original_member_is_lost(etcd: EtcdHandle,
                                                                                         run_id: str) -> None:
    """The split's other path: b lost, b2 takes its place back in place; then a (the last node that formed the round)
    is lost too and b2 trains alone. b2 is named in the rendezvous state in b's place, so a2 started then finds the
    round running and takes a's place; it used to find no running round (the state named only a and b, both gone)
    and form a round of its own beside b2."""
    a, b = _form(etcd, run_id, 2, [1, 1])
    _kill_without_goodbye(b)
    _until_dropped(a)
    b2 = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3, in_place_shrink=1))
    b2.workers_paused = lambda: True
    assert b2.claim_vacancy(1, wait_s=0) is not None
    assert (b2.next_rendezvous().rank, b2.grow_world.size) == (1, 2)
    _until_grown(a)

    _kill_without_goodbye(a)
    _until_dropped(b2)
    a2 = _take_place(etcd, run_id, a, 0, "the node started after both original members were lost found no running "
                     "round: it would train beside b2", in_place_shrink=1)
    assert b2.num_nodes_waiting() == 0
    for h in (b2, a2):
        h.shutdown()


def test_a_node_growing_the_round_a_second_time_does_not_count_the_first_grower(etcd: EtcdHandle,
                                                                                run_id: str) -> None:
    """b lost, b2 takes its place back; b2 lost, b3 takes its place back. b3 must not read b2's grow (b2 took b's
    place) as news: it counted b2, long dead, as a member and asked for a new round once its doubt ran out (seen in a
    goodput run: a drain and a new round 5 s after every second grow)."""
    a, b = _form(etcd, run_id, 2, [1, 1])
    nodes = [b]
    for _ in range(2):
        _kill_without_goodbye(nodes[-1])
        _until_dropped(a)
        a.shrunk.clear()
        new = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3, in_place_shrink=1))
        new.workers_paused = lambda: False  # its workers train on: no evidence that anyone died
        assert new.claim_vacancy(1, wait_s=0) is not None
        assert new.next_rendezvous().world_size == 2
        nodes.append(new)
        _until_grown(a)
        a.grown.clear()
    b3 = nodes[-1]
    deadline = time.monotonic() + 8.0  # past the doubt (5 s) a wrongly counted member would get
    while time.monotonic() < deadline:
        assert b3.num_nodes_waiting() == 0, "the second grower asked for a new round"
        time.sleep(0.2)
    assert b3.grown == [], f"the second grower read an earlier grow as news: {b3.grown}"
    assert a.num_nodes_waiting() == 0
    for h in (a, b3):
        h.shutdown()
