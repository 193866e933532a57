"""Conformance of EtcdV3Backend with torch's RendezvousBackend contract, on a real etcd."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable

from elastictrain.rendezvous.backend import EtcdV3Backend
from elastictrain.rendezvous.client import EtcdClient
from tests.fixtures.etcd import EtcdHandle


def _backend(make_client: Callable[..., EtcdClient], etcd: EtcdHandle, run_id: str) -> EtcdV3Backend:
    return EtcdV3Backend(make_client(etcd.endpoint, run_id), f"/elastictrain/{run_id}/rdzv")


def test_state_round_trip_and_token_is_the_mod_revision(make_client, etcd, run_id) -> None:
    backend = _backend(make_client, etcd, run_id)
    assert backend.name == "etcd3"
    assert backend.get_state() is None

    state, token, written = backend.set_state(b"\x00state-1\xff")
    assert written and state == b"\x00state-1\xff"
    assert backend.get_state() == (b"\x00state-1\xff", token)

    state2, token2, written2 = backend.set_state(b"state-2", token)
    assert written2 and state2 == b"state-2" and token2 > token
    assert backend.get_state() == (b"state-2", token2)


def test_stale_missing_or_foreign_token_does_not_write_and_returns_current_state(make_client, etcd, run_id) -> None:
    backend = _backend(make_client, etcd, run_id)
    _, token, _ = backend.set_state(b"first")
    _, token2, _ = backend.set_state(b"second", token)

    assert backend.set_state(b"stale", token) == (b"second", token2, False)
    assert backend.set_state(b"no token") == (b"second", token2, False)
    assert backend.set_state(b"foreign", "not-a-revision") == (b"second", token2, False)
    assert backend.get_state() == (b"second", token2)


def test_token_for_a_state_that_was_deleted_returns_none(make_client, etcd, run_id) -> None:
    client = make_client(etcd.endpoint, run_id)
    backend = EtcdV3Backend(client, f"/elastictrain/{run_id}/rdzv")
    _, token, _ = backend.set_state(b"x")
    client.delete(backend.key)
    assert backend.set_state(b"y", token) is None


def test_run_ids_do_not_share_state(make_client, etcd, run_id) -> None:
    a = _backend(make_client, etcd, run_id + "a")
    b = _backend(make_client, etcd, run_id + "b")
    a.set_state(b"A")
    assert b.get_state() is None


def test_concurrent_agents_cas_loses_no_update(make_client, etcd, run_id) -> None:
    """8 agents x 25 read-modify-write increments through CAS: every increment lands exactly once."""
    agents, increments = 8, 25
    backends = [_backend(make_client, etcd, run_id) for _ in range(agents)]
    conflicts = [0] * agents

    def agent(i: int) -> None:
        backend = backends[i]
        done = 0
        current = backend.get_state()
        while done < increments:
            value, token = (pickle.loads(current[0]), current[1]) if current else ([], None)
            result = backend.set_state(pickle.dumps([*value, (i, done)]), token)
            assert result is not None
            current = (result[0], result[1])
            if result[2]:
                done += 1
            else:
                conflicts[i] += 1

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    final = pickle.loads(backends[0].get_state()[0])
    assert sorted(final) == sorted((i, n) for i in range(agents) for n in range(increments))
    assert sum(conflicts) > 0  # the test did exercise conflicts
