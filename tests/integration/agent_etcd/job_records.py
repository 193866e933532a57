"""What a finished job left in etcd, read the way an operator's tool reads it."""

from __future__ import annotations

from elastictrain.agent.budget import RestartBudget
from elastictrain.agent.status import Event, read_events
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.settings import EtcdSettings


def restarts_and_events(endpoint: str, run_id: str) -> tuple[int, list[Event]]:
    """The restarts charged to the run's budget, and its event log."""
    settings = EtcdSettings.from_conf(endpoint, run_id, {})
    client = EtcdClient(settings)
    client.connect()
    try:
        return RestartBudget(client, settings.run_prefix).used(), read_events(client, settings.run_prefix)
    finally:
        client.close()
