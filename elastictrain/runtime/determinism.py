"""Seeds, deterministic algorithms, and capture/restore of every RNG a training step can draw from."""

from __future__ import annotations

import hashlib
import os
import random
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch


def derive_seed(seed: int, *parts: int | str) -> int:
    """A 63-bit seed that depends only on (seed, *parts): stable across processes, hosts and Python runs."""
    h = hashlib.sha256(repr((int(seed),) + tuple(parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) with one value."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def configure_determinism(enabled: Union[bool, str]) -> None:
    """Ask torch for deterministic kernels. True: warn-only (an op without one still runs, with a warning). On CUDA
    torch's attention kernels (flash, cuDNN, memory-efficient) then keep their faster non-deterministic backward,
    so runs are not bitwise there. "strict": deterministic kernels, attention included, and torch's own error
    naming any op that has none: the setting for bitwise runs on CUDA."""
    if enabled not in (True, False, "strict"):
        raise ValueError(f"deterministic must be true, false or 'strict', not {enabled!r}")
    if not enabled:
        return
    # cuBLAS needs this before its first handle is created to be deterministic.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=enabled != "strict")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def capture_rng_state(generators: Optional[Mapping[str, torch.Generator]] = None) -> dict[str, Any]:
    """Every RNG state of this process: Python, NumPy, torch CPU, torch CUDA (all devices), named generators."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "generators": {name: g.get_state() for name, g in (generators or {}).items()},
    }
    return state


def restore_rng_state(state: Mapping[str, Any], generators: Optional[Mapping[str, torch.Generator]] = None) -> None:
    """Restore what `capture_rng_state` captured; named generators missing from `state` are left alone."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if state.get("torch_cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])
    for name, g in (generators or {}).items():
        if name in state.get("generators", {}):
            g.set_state(state["generators"][name])
