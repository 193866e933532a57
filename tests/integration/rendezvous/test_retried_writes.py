"""Every etcd write the client retries takes effect once, even when etcd applied it and the reply was lost."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import grpc
import pytest

from elastictrain.rendezvous.backend import EtcdV3Backend
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.store import EtcdStore
from tests.fixtures.etcd import EtcdHandle
from tests.integration.rendezvous.lost_reply import EtcdTransport, intercept

LOST_REPLY_CODES = [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE]


def _store(client: EtcdClient, run_id: str) -> EtcdStore:
    return EtcdStore(client, f"/elastictrain/{run_id}/store", timedelta(seconds=5))


@pytest.fixture
def client(make_client: Callable[..., EtcdClient], etcd: EtcdHandle, run_id: str) -> EtcdClient:
    return make_client(etcd.endpoint, run_id)


@pytest.mark.parametrize("code", LOST_REPLY_CODES, ids=lambda c: c.name)
def test_add_whose_reply_is_lost_moves_the_counter_once(client, run_id, code) -> None:
    store = _store(client, run_id)
    transport = intercept(client)

    transport.lose_next("Txn", code)
    assert store.add("count", 5) == 5
    transport.lose_next("Txn", code)
    assert store.add("count", 3) == 8

    assert transport.lost["Txn"] == 2
    assert store.get("count") == b"8"


def test_concurrent_adds_with_lost_replies_count_each_add_once(make_client, etcd, run_id) -> None:
    agents, adds = 4, 10
    stores = [_store(make_client(etcd.endpoint, run_id), run_id) for _ in range(agents)]
    transports = [intercept(s._client) for s in stores]
    for transport in transports:
        transport.lose_next("Txn", times=3)
    results: list[int] = []

    def agent(store: EtcdStore) -> None:
        for _ in range(adds):
            results.append(store.add("count", 1))

    threads = [threading.Thread(target=agent, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)

    assert sum(t.lost["Txn"] for t in transports) == 3 * agents
    assert sorted(results) == list(range(1, agents * adds + 1))
    assert stores[0].get("count") == str(agents * adds).encode()


def test_barrier_completes_when_the_last_members_add_reply_is_lost(make_client, etcd, run_id) -> None:
    from torch.distributed.elastic.utils.store import barrier

    first, last = (_store(make_client(etcd.endpoint, run_id), run_id) for _ in range(2))
    errors: list[BaseException] = []

    def member(store: EtcdStore) -> None:
        try:
            barrier(store, 2, key_prefix="b/", barrier_timeout=5)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    early = threading.Thread(target=member, args=(first,))
    early.start()
    deadline = time.monotonic() + 10
    while first.num_keys() == 0 and time.monotonic() < deadline:  # the first member has checked in
        time.sleep(0.01)
    intercept(last._client).lose_next("Txn")
    member(last)
    early.join(timeout=10)
    assert errors == []


def test_set_state_whose_reply_is_lost_reports_the_write(client, run_id) -> None:
    backend = EtcdV3Backend(client, f"/elastictrain/{run_id}/rdzv")
    transport = intercept(client)

    transport.lose_next("Txn")
    state, token, written = backend.set_state(b"first")
    assert (state, written) == (b"first", True)
    transport.lose_next("Txn")
    state, token2, written = backend.set_state(b"second", token)
    assert (state, written) == (b"second", True)

    assert transport.lost["Txn"] == 2
    assert backend.get_state() == (b"second", token2)


def test_compare_set_whose_reply_is_lost_returns_the_new_value(client, run_id) -> None:
    store = _store(client, run_id)
    transport = intercept(client)
    transport.lose_next("Txn")
    assert store.compare_set("k", "", "first") == b"first"
    transport.lose_next("Txn")
    assert store.compare_set("k", "first", "second") == b"second"
    assert transport.lost["Txn"] == 2


def test_delete_whose_reply_is_lost_reports_that_the_key_existed(client, run_id) -> None:
    store = _store(client, run_id)
    store.set("k", "v")
    transport = intercept(client)
    transport.lose_next("Txn")
    assert store.delete_key("k")
    assert not store.check(["k"]) and not store.delete_key("k")
    assert transport.lost["Txn"] == 1


def test_conditional_delete_whose_reply_is_lost_reports_the_delete(client, run_id) -> None:
    key = f"/elastictrain/{run_id}/rdzv"
    client.put(key, b"closed")
    _, revision = client.get(key)
    transport = intercept(client)
    transport.lose_next("Txn")
    assert client.delete_if_revision(key, revision)
    assert client.get(key) is None and transport.lost["Txn"] == 1


def test_put_whose_reply_is_lost_is_written_once(client, run_id) -> None:
    store = _store(client, run_id)
    transport = intercept(client)
    transport.lose_next("Put")
    store.set("k", "v")
    assert store.get("k") == b"v" and store.num_keys() == 1 and transport.lost["Put"] == 1


def test_lease_revoke_whose_reply_is_lost_succeeds(client, run_id) -> None:
    lease = client.lease_grant(30)
    key = f"/elastictrain/{run_id}/nodes/n0"
    client.put(key, b"alive", lease=lease)
    transport = intercept(client)
    transport.lose_next("LeaseRevoke")
    client.lease_revoke(lease)
    assert client.get(key) is None and transport.lost["LeaseRevoke"] == 1


def test_request_records_expire_with_a_lease_that_outlives_the_retries(client, run_id) -> None:
    _store(client, run_id).add("count", 1)
    raw = client._raw()  # lease metadata the client does not expose
    records = list(raw.get_prefix(f"/elastictrain/{run_id}/requests/"))
    assert len(records) == 1
    lease = records[0][1].lease_id
    assert lease != 0
    retry_window = client.settings.outage_tolerance + client.settings.request_timeout
    assert raw.get_lease_info(lease).TTL > 2 * retry_window


def test_add_is_one_transaction_on_a_key_this_client_added_to_last(make_client, etcd, run_id) -> None:
    client = make_client(etcd.endpoint, run_id)
    store = _store(client, run_id)
    transport: EtcdTransport = intercept(client)
    store.add("warm-up", 1)  # grants the lease that request records live under

    transport.reset_counts()
    assert store.add("count", 1) == 1
    assert transport.calls == {"Range": 1, "Txn": 1}  # a key this client has not seen: read, then add
    transport.reset_counts()
    assert store.add("count", 2) == 3
    assert transport.calls == {"Txn": 1}
    transport.reset_counts()
    assert store.add("count", 0) == 3
    assert transport.calls == {"Range": 1}

    other = _store(make_client(etcd.endpoint, run_id), run_id)
    assert other.add("count", 1) == 4
    transport.reset_counts()
    assert store.add("count", 1) == 5
    assert transport.calls == {"Txn": 2}  # the guess failed (someone else added), its failure read the value


def test_writes_go_on_after_the_request_records_lease_is_revoked(client, run_id) -> None:
    store = _store(client, run_id)
    store.add("count", 1)
    raw = client._raw()
    [(_, meta)] = raw.get_prefix(f"/elastictrain/{run_id}/requests/")
    client.lease_revoke(meta.lease_id)  # as an operator or a restore from backup might
    assert store.add("count", 1) == 2
