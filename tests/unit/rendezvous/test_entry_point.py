"""The `etcd3` handler is reachable the way torchrun looks it up (no etcd needed)."""

from __future__ import annotations

from elastictrain.rendezvous.entry_point import etcd3_entry_point


def test_entry_point_called_without_arguments_returns_the_creator() -> None:
    # torch's registry calls the loaded entry point with no argument to obtain the creator.
    assert etcd3_entry_point() is etcd3_entry_point


def test_torch_registry_knows_etcd3_once_installed() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    assert rendezvous_handler_registry.create_handler.__self__._registry["etcd3"] is etcd3_entry_point


def test_our_launcher_registers_etcd3_itself_when_no_entry_point_did() -> None:
    """A source tree run without `pip install` has no `torchrun.handlers` metadata: torch then said "The rendezvous
    backend 'etcd3' is not registered" (the first GPU run). The launcher registers it; twice is harmless."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from elastictrain.rendezvous.entry_point import ensure_registered

    registry = rendezvous_handler_registry._registry
    saved = registry.pop("etcd3", None)
    try:
        ensure_registered()
        ensure_registered()
        assert registry["etcd3"] is etcd3_entry_point
    finally:
        if saved is not None:
            registry["etcd3"] = saved
