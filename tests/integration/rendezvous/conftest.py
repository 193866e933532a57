"""Helpers shared by the rendezvous integration tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.settings import EtcdSettings


@pytest.fixture
def make_client() -> Iterator[Callable[..., EtcdClient]]:
    """Build connected EtcdClients (closed at teardown): make_client(endpoint, run_id, **conf)."""
    clients: list[EtcdClient] = []

    def make(endpoint: str, run_id: str, **conf: object) -> EtcdClient:
        client = EtcdClient(EtcdSettings.from_conf(endpoint, run_id, dict(conf)))
        client.connect()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
