"""A lost node's place held for an in-place take-over (`--rdzv-conf in_place_rejoin`, rendezvous/vacancy.py), with
the real handler on a real etcd: survivors do not ask for a new round while the place is held; a new node of the
same size takes it (the lost node's group rank in the running round, its store and bootstrap address); a node of
another size cannot; an unclaimed place expires and the survivors then ask for a new round."""

from __future__ import annotations

import json
import time

from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.etcd_handler import EtcdRendezvousHandler, create_etcd_handler
from elastictrain.rendezvous.settings import EtcdSettings
from elastictrain.rendezvous.vacancy import Vacancies
from tests.fixtures.etcd import EtcdHandle
from tests.integration.rendezvous.test_handler import _kill_without_goodbye, _params, _rendezvous_all

Two = tuple[EtcdRendezvousHandler, EtcdRendezvousHandler, list]


def _form_two(etcd: EtcdHandle, run_id: str, hold_s: float, max_nodes: int = 2) -> Two:
    """Two nodes in round 1 (1 worker each, as torch's agent records it in the round's store); (lost, survivor)."""
    handlers = [create_etcd_handler(_params(etcd.endpoint, run_id, 1, max_nodes, in_place_rejoin=hold_s))
                for _ in range(2)]
    infos = _rendezvous_all(handlers)
    for info in infos:
        info.store.set(f"torchelastic/role_info/{info.rank}", json.dumps({"role": "default", "rank": info.rank,
                                                                          "local_world_size": 1}))
    # The harder case: the lost node held group rank 0 (it also wrote the round's bootstrap address).
    lost, survivor = sorted(handlers, key=lambda h: infos[handlers.index(h)].rank)
    return lost, survivor, infos


def _vacancies(etcd: EtcdHandle, run_id: str, hold_s: float) -> Vacancies:
    client = EtcdClient(EtcdSettings.from_conf(etcd.endpoint, run_id, {}))
    client.connect()
    return Vacancies(client, EtcdSettings.from_conf(etcd.endpoint, run_id, {}).run_prefix, hold_s)


def _wait_for_offer(survivor: EtcdRendezvousHandler, vacancies: Vacancies, lost: str) -> None:
    start = time.monotonic()
    while not vacancies.is_open(lost):
        assert survivor.num_nodes_waiting() == 0, "the survivor asked for a new round instead of holding the place"
        assert time.monotonic() - start < 10, "the lost node's place was never offered"
        time.sleep(0.1)


def test_a_new_node_of_the_same_size_takes_the_lost_nodes_place_in_the_running_round(etcd: EtcdHandle,
                                                                                    run_id: str) -> None:
    lost, survivor, infos = _form_two(etcd, run_id, hold_s=30)
    boot = infos[0].bootstrap_store_info
    vacancies = _vacancies(etcd, run_id, 30)
    _kill_without_goodbye(lost)
    _wait_for_offer(survivor, vacancies, lost.this_node)

    bigger = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 2, in_place_rejoin=30))
    assert bigger.claim_vacancy(local_world_size=2, wait_s=0) is None, \
        "a node with 2 workers took the place of one with 1"
    newcomer = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 2, in_place_rejoin=30))
    claim = newcomer.claim_vacancy(local_world_size=1)
    assert claim is not None and claim.lost == lost.this_node and claim.group_rank == 0
    assert bigger.claim_vacancy(local_world_size=1, wait_s=0) is None, "one place was taken twice"

    info = newcomer.next_rendezvous()  # no round: the lost node's place in round of the survivor
    assert (info.rank, info.world_size) == (0, 2)
    assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == \
        (boot.master_addr, boot.master_port)
    assert json.loads(info.store.get("torchelastic/role_info/0"))["local_world_size"] == 1, "not the round's store"
    assert newcomer.took_over is not None and newcomer.took_over.lost == lost.this_node

    for _ in range(10):  # the survivor now counts the newcomer as the member, not the lost node
        assert survivor.num_nodes_waiting() == 0
        time.sleep(0.1)
    assert vacancies.claimer(lost.this_node) == newcomer.this_node
    assert not vacancies.is_open(lost.this_node)

    # The newcomer is a member like any other: when it is lost too, its place is held again.
    _kill_without_goodbye(newcomer)
    _wait_for_offer(survivor, vacancies, newcomer.this_node)
    for h in (survivor, bigger):
        h.shutdown()
    vacancies.client.close()


def test_an_unclaimed_place_expires_and_the_survivor_asks_for_a_new_round(etcd: EtcdHandle, run_id: str) -> None:
    lost, survivor, _ = _form_two(etcd, run_id, hold_s=2)
    vacancies = _vacancies(etcd, run_id, 2)
    _kill_without_goodbye(lost)
    _wait_for_offer(survivor, vacancies, lost.this_node)
    start = time.monotonic()
    while survivor.num_nodes_waiting() == 0:
        assert time.monotonic() - start < 15, "the held place never expired"
        time.sleep(0.1)
    late = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 2, in_place_rejoin=2))
    assert late.claim_vacancy(local_world_size=1, wait_s=0) is None, "an expired place was taken"
    infos = _rendezvous_all([survivor, late])  # the usual way in: a new round
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    for h in (survivor, late):
        h.shutdown()
    vacancies.client.close()


def test_a_node_whose_lease_lapsed_and_that_registered_again_is_not_held_and_its_place_cannot_be_taken(
        etcd: EtcdHandle, run_id: str) -> None:
    """An agent starved of CPU for its lease's TTL (seen at 150M on 2 cores) drops out of etcd and registers again,
    its workers running on: its place must not stay on offer (a new node would take the ranks of live workers),
    and the survivors ask for a new round at once, as without a held place, instead of after `rejoin_wait_s`."""
    lost, survivor, _ = _form_two(etcd, run_id, hold_s=30)
    vacancies = _vacancies(etcd, run_id, 30)
    lost.liveness._client.lease_revoke(lost.liveness._lease_id)  # its keep-alive thread registers it again
    start = time.monotonic()
    while survivor.num_nodes_waiting() == 0:
        assert time.monotonic() - start < 10, "the survivor kept holding the place of a node that came back"
        time.sleep(0.1)
    assert not vacancies.is_open(lost.this_node)
    newcomer = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 2, in_place_rejoin=30))
    assert newcomer.claim_vacancy(local_world_size=1, wait_s=0) is None, "a new node took the place of a live one"
    for h in (lost, survivor, newcomer):
        h.shutdown()
    vacancies.client.close()


def test_a_node_started_before_the_lost_nodes_lease_expired_waits_for_its_place_instead_of_joining(
        etcd: EtcdHandle, run_id: str) -> None:
    """The same command started again at once (a supervisor restarting it) meets a running round with no place
    offered yet: the lost node's lease has not expired, or it has and the survivors have not looked since (one
    monitor tick; a clean-clone CI run hit that window). It waits for the place rather than join the round as a
    scale-up, which would make the survivors restart every worker. Here: the second window, the harder one (the
    lost node is already out of the round's state when the newcomer reads it)."""
    import threading

    lost, survivor, _ = _form_two(etcd, run_id, hold_s=30)
    _kill_without_goodbye(lost)
    time.sleep(3.0)  # past the lease's TTL (2 s), and the survivor has not looked yet
    newcomer = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 2, in_place_rejoin=30))
    claims: list = []
    t = threading.Thread(target=lambda: claims.append(newcomer.claim_vacancy(local_world_size=1)), daemon=True)
    t.start()
    while t.is_alive():
        assert survivor.num_nodes_waiting() == 0, "the survivor asked for a new round"
        time.sleep(0.1)
    assert claims and claims[0] is not None and claims[0].lost == lost.this_node, \
        "the early node did not wait for the lost node's place"
    info = newcomer.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 2)
    for h in (survivor, newcomer):
        h.shutdown()


def test_a_claim_landing_while_the_survivor_checks_the_place_is_seen_as_taken_not_expired(etcd: EtcdHandle,
                                                                                         run_id: str) -> None:
    """A clean-clone CI run caught the survivor reading the claim (none yet), then the offer (gone: claimed just
    then), and calling the place expired: every worker restarted. The claim is forced into that moment here."""
    lost, survivor, _ = _form_two(etcd, run_id, hold_s=30)
    vacancies = _vacancies(etcd, run_id, 30)
    _kill_without_goodbye(lost)
    _wait_for_offer(survivor, vacancies, lost.this_node)
    newcomer = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 2, in_place_rejoin=30))
    held = survivor._vacancies
    assert held is not None
    is_open = held.is_open

    def claimed_meanwhile(check):
        def read(node: str):
            if newcomer.took_over is None and newcomer._claim is None:
                assert newcomer.claim_vacancy(local_world_size=1, wait_s=0) is not None
            return check(node)
        return read

    held.is_open = claimed_meanwhile(is_open)  # the claim lands as the survivor reads the offer
    assert survivor.num_nodes_waiting() == 0, "a place taken while the survivor looked was called expired"
    assert survivor.num_nodes_waiting() == 0
    for h in (survivor, newcomer):
        h.shutdown()
    vacancies.client.close()


def test_a_node_that_scales_a_running_job_up_waits_once_for_a_place_then_joins_a_new_round(etcd: EtcdHandle,
                                                                                           run_id: str) -> None:
    """`claim_vacancy`'s cost for a node that is no one's replacement: with no place on offer in the running round
    it waits the lease's TTL + 5 s (a lost node's place may still come: see the test above), the round undisturbed
    meanwhile, then finds none and joins as usual, and the job re-forms with it. The agent calls it once, at its
    first rendezvous (agent.py `_rendezvous`); its later rounds do not wait."""
    import threading

    a, b, _ = _form_two(etcd, run_id, hold_s=30, max_nodes=3)
    newcomer = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3, in_place_rejoin=30))
    claims: list = []
    start = time.monotonic()
    t = threading.Thread(target=lambda: claims.append(newcomer.claim_vacancy(local_world_size=1)), daemon=True)
    t.start()
    while t.is_alive():
        assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0, "the newcomer disturbed the round early"
        time.sleep(0.1)
    waited = time.monotonic() - start
    assert claims == [None], "a place was claimed where none was lost"
    assert 2 + 5 - 0.5 <= waited <= 2 + 5 + 3, f"waited {waited:.1f}s, expected the lease's TTL (2 s) + 5 s"
    infos = _rendezvous_all([a, b, newcomer])
    assert sorted(i.rank for i in infos) == [0, 1, 2] and {i.world_size for i in infos} == {3}
    assert newcomer.took_over is None
    for h in (a, b, newcomer):
        h.shutdown()


def test_a_node_waiting_for_a_place_stops_waiting_as_soon_as_the_survivors_ask_for_a_new_round(
        etcd: EtcdHandle, run_id: str) -> None:
    """`claim_vacancy`'s wait (up to the lease's TTL + 5 s) is for a place that may still be offered; once the running
    round's members leave it for a new one (a loss they could not keep a place for, or any re-form), no place will
    come, and the node joins the new round at once instead of after the wait."""
    import threading

    a, b, _ = _form_two(etcd, run_id, hold_s=30, max_nodes=3)
    newcomer = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3, in_place_rejoin=30))
    claims: list = []
    t = threading.Thread(target=lambda: claims.append(newcomer.claim_vacancy(local_world_size=1)), daemon=True)
    t.start()
    time.sleep(1.0)
    assert t.is_alive(), "the newcomer did not wait for a place in the running round"
    left = time.monotonic()
    rejoin = threading.Thread(target=_rendezvous_all, args=([a, b],), daemon=True)
    rejoin.start()  # both members leave the round for a new one
    t.join(timeout=15)
    ended = time.monotonic() - left
    assert claims == [None], "a place was claimed where none was lost"
    assert ended < 3.0, f"the newcomer waited {ended:.1f} s after the round ended (its whole wait is 7 s)"
    rejoin.join(timeout=30)
    for h in (a, b, newcomer):
        h.shutdown()
