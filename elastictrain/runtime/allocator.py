"""The host memory allocator of a training worker (glibc malloc): freed memory kept in the process for reuse.

glibc gives a freed block of more than 128 KiB back to the kernel at once (its own mmap, or the heap's top trimmed)
and raises that threshold only as such blocks are freed. A CPU training step frees and allocates hundreds of MB of
gradients and activations every step, and each fresh page costs a fault and a zeroing by the kernel on the next
touch: measured on a 2-core VM, one process training scale.py's 50M model stepped in 0.29 s with glibc's defaults
and 0.22 s with freed memory kept (150M: 0.85-0.94 s against 0.69 s; the tiny model: no difference); two FSDP2
ranks, where communication takes more of the step, 5-8 % faster (benchmarks/allocator.py).

`tune_malloc` sets `M_MMAP_THRESHOLD` to 32 MiB (glibc's own ceiling for its dynamic threshold: blocks up to that
come from the heap, larger ones are mapped and unmapped as before) and `M_TRIM_THRESHOLD` to 2 GiB (free memory at
the heap's top is given back only above that). The cost: a worker's resident memory stays at its peak instead of
falling between steps, and after a re-form at a smaller shard (a grow) it keeps the larger one's pages, free for
its own reuse, not for other processes. `elastic.worker_malloc: default` leaves glibc as it is; a worker whose
environment already sets glibc's malloc variables (`MALLOC_*_`, `GLIBC_TUNABLES` with `glibc.malloc`) is left as it
is too. Nothing happens off glibc (musl, macOS) or where `mallopt` is missing. On GPU nodes the device memory has
torch's own caching allocator; this only concerns host memory (data loading, CPU training, snapshot staging).

Huge pages (`elastic.worker_huge_pages`, off by default): the agent starts its workers (and their warm spares, which
load torch before they are given a job) with torch's `THP_MEM_ALLOC_ENABLE=1`, so that torch asks the kernel for
transparent huge pages for every host block of 2 MiB or more: fewer TLB misses and one fault per 2 MiB of fresh
memory instead of 512. Measured here (docs/benchmarks.md "Huge pages"): CPU steps 9-15 % faster at 50M-150M
parameters, but resident memory 25-35 % higher (blocks aligned to 2 MiB, huge pages partly used), and the allocation
of a smaller world's bigger shards 3-6x slower when both ranks of a node did it at once (fresh huge pages found by
compacting memory). A trade for the user to make, not a default. It needs the kernel's policy
(/sys/kernel/mm/transparent_hugepage/enabled) at `madvise` or `always`; under `never` nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from typing import Mapping, Optional

log = logging.getLogger(__name__)

ENV_WORKER_MALLOC = "ELASTICTRAIN_WORKER_MALLOC"
"""Set by the agent for its workers from `elastic.worker_malloc`: `tuned` (the default) or `default`."""

ENV_TORCH_THP = "THP_MEM_ALLOC_ENABLE"
"""torch's own switch (read once, as torch loads): its CPU allocator aligns blocks of 2 MiB or more to 2 MiB and
advises the kernel to back them with transparent huge pages (`madvise(MADV_HUGEPAGE)`). The agent sets it to 1 for
its workers when `elastic.worker_huge_pages` is on and the environment does not set it already."""

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20
"""glibc's ceiling for the mmap threshold on 64-bit hosts (`DEFAULT_MMAP_THRESHOLD_MAX`); mallopt refuses more."""
TRIM_THRESHOLD = (1 << 31) - 1
"""The largest value mallopt's int takes: free memory at the heap's top is given back above ~2 GiB only."""
_USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def user_settings(env: Mapping[str, str]) -> Optional[str]:
    """The variable through which the environment already tunes glibc's malloc, if any (left alone)."""
    for name in _USER_VARS:
        if name in env:
            return name
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def tune_malloc(env: Optional[Mapping[str, str]] = None) -> Optional[dict[str, int]]:
    """Keep freed memory in this process for reuse (module docstring), unless `env` (os.environ) says
    `ELASTICTRAIN_WORKER_MALLOC=default` or tunes malloc itself; the settings applied, or None."""
    env = os.environ if env is None else env
    mode = env.get(ENV_WORKER_MALLOC, "tuned")
    if mode != "tuned":
        return None
    own = user_settings(env)
    if own is not None:
        log.debug("glibc malloc left as %s sets it", own)
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = {}
    for name, param, value in (("mmap_threshold", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                               ("trim_threshold", M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if mallopt(param, value) == 1:  # 1 on success
            applied[name] = value
        else:
            log.debug("mallopt(%s, %d) was refused", name, value)
    return applied or None


def worker_huge_pages_env(enabled: bool, env: Mapping[str, str]) -> dict[str, str]:
    """What the agent adds to its workers' environment for `elastic.worker_huge_pages`: torch's switch on, unless
    the setting is off or the environment sets the switch itself (kept as it is either way)."""
    if not enabled or ENV_TORCH_THP in env:
        return {}
    return {ENV_TORCH_THP: "1"}
