"""torchrun's `etcd3` rendezvous backend: the `torchrun.handlers` entry point (the handler: `etcd_handler.py`).

torch's registry (`_register_out_of_tree_handlers`) loads the `torchrun.handlers` entry point and
*calls it with no argument* to get the creator, then calls the creator with the parameters. So
`etcd3_entry_point()` returns itself and `etcd3_entry_point(params)` creates a handler: the one name in
pyproject.toml serves both calls.

This module imports nothing from torch at import time: torch loads the entry points while
`torch.distributed.elastic.rendezvous` is itself being imported, and a module-level import of it
from here would be circular when elastictrain is imported first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from elastictrain.rendezvous.etcd_handler import EtcdRendezvousHandler

Creator = Callable[["RendezvousParameters"], "EtcdRendezvousHandler"]


@overload
def etcd3_entry_point(params: None = None) -> Creator: ...
@overload
def etcd3_entry_point(params: RendezvousParameters) -> EtcdRendezvousHandler: ...
def etcd3_entry_point(params: RendezvousParameters | None = None) -> EtcdRendezvousHandler | Creator:
    """Create the `etcd3` rendezvous handler from torchrun's `--rdzv-*` parameters (no argument: the creator)."""
    if params is None:
        return etcd3_entry_point
    from elastictrain.rendezvous.etcd_handler import create_etcd_handler

    return create_etcd_handler(params)


def ensure_registered() -> None:
    """Register the `etcd3` backend with torch's registry where the entry point did not (the project run from a
    source tree that pip never installed, so no `torchrun.handlers` metadata); a no-op where it did (the same
    creator). Our own launcher calls it; plain `torchrun --rdzv-backend etcd3` needs the installed package."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register("etcd3", etcd3_entry_point)
