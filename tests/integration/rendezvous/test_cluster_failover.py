"""A 3-member etcd cluster: losing the member an agent talks to does not disturb the rendezvous."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastictrain.rendezvous.embedded import EmbeddedEtcd, free_port
from elastictrain.rendezvous.etcd_handler import create_etcd_handler


@pytest.fixture
def cluster() -> Iterator[list[EmbeddedEtcd]]:
    peers = [free_port("127.0.0.1") for _ in range(3)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(peers))
    members = [EmbeddedEtcd(name=f"m{i}", peer_port=p, initial_cluster=initial) for i, p in enumerate(peers)]
    try:
        for m in members:
            m.start(wait=False)
        for m in members:
            m.wait_healthy()
        yield members
    finally:
        for m in members:
            m.close()


def test_agents_fail_over_when_their_etcd_member_dies(cluster: list[EmbeddedEtcd], run_id: str) -> None:
    endpoints = ",".join(m.endpoint for m in cluster)
    params = RendezvousParameters("etcd3", endpoints, run_id, 2, 2, lease_ttl=2, last_call_timeout=1)
    handlers = [create_etcd_handler(params) for _ in range(2)]
    infos: list = [None, None]

    def join_all() -> None:
        threads = [threading.Thread(target=lambda i=i: infos.__setitem__(i, handlers[i].next_rendezvous()))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)

    join_all()
    assert sorted(i.rank for i in infos) == [0, 1]

    in_use = handlers[0]._client._raw().endpoint_in_use.netloc
    victim = next(m for m in cluster if m.endpoint == in_use)
    victim.stop()

    # Over several lease periods: nobody is declared lost, the store and the state still work.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        assert handlers[0].num_nodes_waiting() == 0
        assert handlers[1].num_nodes_waiting() == 0
        time.sleep(0.2)
    infos[0].store.set("after-failover", "ok")
    assert infos[1].store.get("after-failover") == b"ok"
    assert handlers[0]._client._raw().endpoint_in_use.netloc != in_use

    join_all()  # a new round completes through the remaining members
    assert sorted(i.rank for i in infos) == [0, 1]
    for h in handlers:
        h.shutdown()
