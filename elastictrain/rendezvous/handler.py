"""Entry point of the `etcd3` torchrun rendezvous handler (implementation: `etcd_handler.py`).

torch's registry (`_register_out_of_tree_handlers`) loads the `torchrun.handlers` entry point and
*calls it with no argument* to get the creator, then calls the creator with the parameters. So
`create_handler()` returns itself and `create_handler(params)` creates a handler: the one name in
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
def create_handler(params: None = None) -> Creator: ...
@overload
def create_handler(params: RendezvousParameters) -> EtcdRendezvousHandler: ...
def create_handler(params: RendezvousParameters | None = None) -> EtcdRendezvousHandler | Creator:
    """Create the `etcd3` rendezvous handler from torchrun's `--rdzv-*` parameters (no argument: the creator)."""
    if params is None:
        return create_handler
    from elastictrain.rendezvous.etcd_handler import create_handler as _create

    return _create(params)
