"""Allocation of large CPU buffers that are written before they are read (receive buffers, staging buffers, the
shards of a model built on the meta device)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def unfilled() -> Iterator[None]:
    """`torch.empty` inside allocates without writing: with deterministic algorithms on, torch fills every new tensor
    (NaN, or an integer type's largest value) so that a read of uninitialised memory is reproducible. For a buffer
    that is only ever read where it was written first, that fill is a wasted pass over fresh memory: the kernel
    zeroes each page at its first touch, and on a VM backed on first touch a 1.8 GB receive buffer took 5 s to fill
    (a 150M model's grow). The setting is the process's: another thread's allocations meanwhile are not filled either
    (harmless to code that reads only what it wrote)."""
    import torch.utils.deterministic as det

    old = det.fill_uninitialized_memory
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        det.fill_uninitialized_memory = old
