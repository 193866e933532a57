"""EtcdStore behaves like the c10d stores torch's agent relies on, on a real etcd."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastictrain.rendezvous.store import EtcdStore


@pytest.fixture
def store(make_client, etcd, run_id) -> EtcdStore:
    return EtcdStore(make_client(etcd.endpoint, run_id), f"/elastictrain/{run_id}/store", timedelta(seconds=5))


def test_set_get_check_delete_and_num_keys(store: EtcdStore) -> None:
    store.set("a", "text")
    store.set("b", b"\x00\xffbin")
    assert store.get("a") == b"text"
    assert store.get("b") == b"\x00\xffbin"
    assert store.check(["a", "b"]) and not store.check(["a", "zz"])
    assert store.num_keys() == 2
    assert store.delete_key("a") and not store.delete_key("a")
    assert store.multi_get(["b"]) == [b"\x00\xffbin"]


def test_get_blocks_until_another_agent_sets_the_key(store: EtcdStore) -> None:
    threading.Timer(0.3, store.set, args=("late", "v")).start()
    start = time.monotonic()
    assert store.get("late") == b"v"
    assert 0.25 < time.monotonic() - start < 2


def test_wait_times_out_with_a_store_error(store: EtcdStore) -> None:
    with pytest.raises(dist.DistStoreError, match="never"):
        store.wait(["never"], timedelta(seconds=0.3))


def test_add_is_atomic_under_concurrency(store: EtcdStore) -> None:
    def bump() -> None:
        for _ in range(20):
            store.add("counter", 1)

    threads = [threading.Thread(target=bump) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.add("counter", 0) == 100


def test_compare_set_follows_tcpstore_semantics(store: EtcdStore) -> None:
    assert store.compare_set("k", "", "first") == b"first"
    assert store.compare_set("k", "wrong", "x") == b"first"
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.compare_set("missing", "expected", "x") == b"expected"


def test_works_under_torch_prefix_store_and_elastic_barrier(store: EtcdStore) -> None:
    from torch.distributed.elastic.utils.store import barrier, synchronize

    prefixed = dist.PrefixStore("torch.rendezvous.job.0", store)
    results: dict[int, list[bytes]] = {}

    def agent(rank: int) -> None:
        results[rank] = synchronize(prefixed, f"r{rank}".encode(), rank, 3, "sync/", timeout=10)
        barrier(prefixed, 3, key_prefix="b/", barrier_timeout=10)

    threads = [threading.Thread(target=agent, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(results[r] == [b"r0", b"r1", b"r2"] for r in range(3))
