"""The `etcd3` handler is reachable the way torchrun looks it up (no etcd needed)."""

from __future__ import annotations

from elastictrain.rendezvous.entry_point import etcd3_entry_point


def test_entry_point_called_without_arguments_returns_the_creator() -> None:
    # torch's registry calls the loaded entry point with no argument to obtain the creator.
    assert etcd3_entry_point() is etcd3_entry_point


def test_torch_registry_knows_etcd3_once_installed() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    assert rendezvous_handler_registry.create_handler.__self__._registry["etcd3"] is etcd3_entry_point
