"""The snapshot tier's memory budget (`checkpoint.snapshot_memory`), checked once before a worker's first snapshot.

A node whose snapshots cannot fit stops at start-up with one line that names the numbers and the fix, instead of
filling /dev/shm in the middle of a run (where a full RAM file system only turns snapshots off) or pushing the node
into swap and the OOM killer. Plain arithmetic on sizes and `os.statvfs`: no torch, so it is testable on its own.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union

from elastictrain.checkpoint.snapshot_folders import bytes_held
from elastictrain.config import DEFAULT_SNAPSHOT_FS_FRACTION, parse_memory_size
from elastictrain.errors import ConfigError

SLOTS_PER_RANK = 2
"""Each rank's double buffer (checkpoint/snapshot.py): the newest committed snapshot stays while the next is
written."""
DURABLE_SLOTS_PER_RANK = 1
"""With durable checkpoints written from the snapshots, the slot a save reads stays as it is while two others
rotate. It replaces the staging buffer an async save from the live state keeps (one more copy in worker memory)."""
REPLICA_SLOTS_PER_RANK = 2
"""With peer replicas, a node also holds the two newest replicated slots of each rank of one peer node (which runs
as many ranks as this one): agent/replication.py keeps two per source rank, so a slot rewritten in transfer never
leaves the peer without a committed replica."""

log = logging.getLogger(__name__)

_FIELD = "checkpoint.snapshot_memory"
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@dataclass(frozen=True)
class SnapshotBudget:
    """What the snapshots of one node need and what they may use (bytes)."""

    needed: int
    budget: int
    budget_from: str
    """How `budget` was set, for messages: the setting, or the default it was derived from."""
    available: int
    """The free space of the file system under the snapshot folder plus what the folder holds already (its slot
    files are rewritten in place, and other ranks of the node may have committed theirs first)."""


def slots_per_rank(replica: bool, durable: bool) -> int:
    """Slots a node holds per local rank: its own two, one held by a durable save, two of a peer's replica."""
    return SLOTS_PER_RANK + (DURABLE_SLOTS_PER_RANK if durable else 0) + (REPLICA_SLOTS_PER_RANK if replica else 0)


def snapshot_bytes_needed(state_bytes_per_rank: int, local_ranks: int, replica: bool, durable: bool = False) -> int:
    """The bytes one node's snapshots take: `slots_per_rank` slots per local rank."""
    return slots_per_rank(replica, durable) * local_ranks * state_bytes_per_rank


def ram_per_state_gb(nodes: int = 1, replica: bool = False, durable: bool = False) -> float:
    """GB of RAM the snapshots take on each node per GB of the job's train state, spread evenly over `nodes`."""
    return snapshot_bytes_needed(1, 1, replica, durable) / nodes


def host_memory_bytes() -> int:
    """The node's RAM, or the container's memory limit when lower (pages of a RAM file system count against it)."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in _CGROUP_LIMITS:
        try:
            limit = Path(path).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():  # "max" (v2) or a huge number (v1) when unlimited
            ram = min(ram, int(limit))
    return ram


def _statvfs(folder: Path) -> os.statvfs_result:
    """The file system of `folder`, or of its nearest existing parent (the agent makes the folder; a check run
    before that still sees the right mount)."""
    for p in (folder, *folder.parents):
        if p.exists():
            return os.statvfs(p)
    return os.statvfs("/")


def _human(n: int) -> str:
    unit, scale = next(((u, s) for u, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)) if n >= s),
                       ("B", 1))
    return f"{n / scale:.2f} {unit}" if scale > 1 else f"{n} B"


def _exact(n: int) -> str:
    return f"{n} bytes ({_human(n)})"


def resolve_budget(setting: Union[int, float, str, None], folder: Path) -> tuple[int, str]:
    """(bytes, how they were chosen) of a `checkpoint.snapshot_memory` setting for snapshots kept in `folder`."""
    value = parse_memory_size(setting, _FIELD)
    if value is None:
        fs = _statvfs(folder)
        size = fs.f_blocks * fs.f_frsize
        return int(size * DEFAULT_SNAPSHOT_FS_FRACTION), (
            f"unset: {DEFAULT_SNAPSHOT_FS_FRACTION:g} of the {_human(size)} file system under {folder}")
    if isinstance(value, float):
        ram = host_memory_bytes()
        return int(ram * value), f"{setting}: that fraction of the node's {_human(ram)} of RAM"
    return value, f"set to {setting}"


def check_snapshot_budget(state_bytes_per_rank: int, local_ranks: int, budget: Union[int, float, str, None],
                          folder: Path, replica: bool, durable: bool = False) -> SnapshotBudget:
    """Raise ConfigError (not restartable) when this node's snapshots do not fit in the budget or in the free space
    under `folder`; otherwise return the numbers (for a log line)."""
    needed = snapshot_bytes_needed(state_bytes_per_rank, local_ranks, replica, durable)
    limit, limit_from = resolve_budget(budget, folder)
    fs = _statvfs(folder)
    available = fs.f_bavail * fs.f_frsize + bytes_held(folder)
    plan = SnapshotBudget(needed=needed, budget=limit, budget_from=limit_from, available=available)
    if needed <= min(limit, available):
        return plan
    own = SLOTS_PER_RANK + (DURABLE_SLOTS_PER_RANK if durable else 0)
    slots = f"({own} slots + a peer node's replica)" if replica else f"{own} slots"
    why = [f"{_FIELD} allows {limit} bytes ({_human(limit)}, {limit_from})"] if needed > limit else []
    fix = [f"raise {_FIELD}"] if needed > limit else []
    if needed > available:
        why.append(f"the file system under {folder} has {_exact(available)} free")
        fix.insert(0, "give that file system more room (a bigger /dev/shm: docker run --shm-size, or a "
                      "Kubernetes emptyDir of medium Memory)")
    raise ConfigError(f"in-memory snapshots need {_exact(needed)} on this node ({slots} x {local_ranks} local "
                      f"rank(s) x {_human(state_bytes_per_rank)} of train state per rank) but {' and '.join(why)}; "
                      f"{' and '.join(fix)}, run fewer ranks per node, or turn snapshots off with "
                      f"checkpoint.snapshot_every_steps=0")


def room_check(budget: Union[int, float, str, None], folder: Path, local_ranks: int,
               replica: bool, durable: bool = False) -> Callable[[int], None]:
    """The check a `SnapshotStore` runs before it first reserves its slots (and when the state grows): raises
    `check_snapshot_budget`'s ConfigError, logs the numbers once when they fit."""
    def check(state_bytes_per_rank: int) -> None:
        plan = check_snapshot_budget(state_bytes_per_rank, local_ranks, budget, folder, replica, durable)
        log.info("in-memory snapshots need %s on this node of %s allowed (%s), %s free", _human(plan.needed),
                 _human(plan.budget), plan.budget_from, _human(plan.available))
    return check
