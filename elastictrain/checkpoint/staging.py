"""Staging for async saves into CPU buffers that are allocated once and reused by every save.

DCP's default CPU staging allocates a fresh copy of the whole state per save; on the machines we
measured, faulting in hundreds of MB of new pages took 1-8 s per save (seconds of blocked training),
while copying into buffers that already exist takes a memcpy. The cost is one resident host copy of
this rank's shard of the state. Reuse is safe because the manager never stages while a save is in flight.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor


def _signature(obj: Any) -> Any:
    """Structure, shapes and dtypes: when they change (e.g. optimizer state appears), buffers are rebuilt."""
    if isinstance(obj, DTensor):
        return ("dt", tuple(obj.to_local().shape), obj.dtype, obj.placements)
    if isinstance(obj, torch.Tensor):
        return ("t", tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_signature(v) for v in obj))
    return type(obj).__name__


class ReusedCpuStager(AsyncStager):
    """An AsyncStager whose stage() copies into CPU buffers kept from the previous save (same structure)."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._cache: Optional[dict[str, Any]] = None
        self._sig: Any = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        sig = _signature(state_dict)
        if self._cache is None or sig != self._sig:
            self._cache = _create_cpu_state_dict(state_dict, pin_memory=False, share_memory=False)
            self._sig = sig
        # Non-tensor leaves (ints, strings, bytes) are taken by reference: they are immutable.
        return _copy_state_dict(state_dict, self._cache, type_check=False)

    def synchronize_staging(self) -> None:
        """Staging is a synchronous copy: nothing to wait for."""

    def close(self) -> None:
        self._cache = None
        self._sig = None
