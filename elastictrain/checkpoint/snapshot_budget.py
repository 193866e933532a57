"""The snapshot tier's memory budget (`checkpoint.snapshot_memory`), checked once before a worker's first snapshot.

A node whose snapshots cannot fit stops at start-up (a job that has trained skips them and retries instead:
runtime/checkpointing.py) with one line that names the numbers and the fix, instead of filling /dev/shm in the
middle of a run (where a full RAM file system only turns snapshots off) or pushing the node
into swap and the OOM killer. Plain arithmetic on sizes, `os.statvfs` and /proc/meminfo: no torch, so it is testable
on its own.

Several agents may share one host and its /dev/shm: two jobs on one machine, or the simulated nodes of a test. Each
check therefore writes what its node needs into its agent's folder (`PLAN_FILE`, under a lock on the snapshot base)
and counts what the other live agents' folders plan or hold: the default budget (a share of the file system) is
shared by all of them, and their slots not yet written count against the free space and the free RAM, so that the
second agent stops with the numbers at start-up instead of both being OOM-killed minutes later.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import psutil

from elastictrain.checkpoint.snapshot_folders import RUN_FOLDER, bytes_held, run_folders
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
_CGROUP_USAGE = ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes")

PLAN_FILE = "budget.json"
"""In an agent's run folder: `{"needed": bytes}`, what its node's snapshots were last checked to need (own slots and
a peer's replicas), read by the checks of other agents on the same host before those bytes are all written."""
_LOCK_FILE = ".budget.lock"
"""In the snapshot base: held while a check reads the other agents' plans and writes its own."""


@dataclass(frozen=True)
class OtherAgent:
    """Another live agent's snapshot folder on the same file system, and the bytes it claims."""

    path: Path
    planned: int
    held: int

    @property
    def claim(self) -> int:
        return max(self.planned, self.held)

    @property
    def pending(self) -> int:
        """Bytes it planned and has not written yet (they will come out of the free space and RAM)."""
        return max(0, self.planned - self.held)


@dataclass(frozen=True)
class SnapshotBudget:
    """What the snapshots of one node need and what they may use (bytes)."""

    needed: int
    budget: int
    budget_from: str
    """How `budget` was set, for messages: the setting, or the default it was derived from."""
    available: int
    """The free space of the file system under the snapshot folder plus what the folder holds already (its slot
    files are rewritten in place, and other ranks of the node may have committed theirs first), less what other
    agents on the host planned and have not written yet."""
    ram_free: Optional[int] = None
    """The memory the host (or the container) can still give, less what other agents planned and have not written
    yet; the slots this node has not written yet must fit in it. None where it cannot be read."""
    others: tuple[OtherAgent, ...] = field(default=())


def slots_per_rank(replica: bool, durable: bool) -> int:
    """Slots a node holds per local rank: its own two, one held by a durable save, two of a peer's replica."""
    return SLOTS_PER_RANK + (DURABLE_SLOTS_PER_RANK if durable else 0) + (REPLICA_SLOTS_PER_RANK if replica else 0)


def snapshot_bytes_needed(state_bytes_per_rank: int, local_ranks: int, replica: bool, durable: bool = False) -> int:
    """The bytes one node's snapshots take: `slots_per_rank` slots per local rank."""
    return slots_per_rank(replica, durable) * local_ranks * state_bytes_per_rank


def ram_per_state_gb(nodes: int = 1, replica: bool = False, durable: bool = False) -> float:
    """GB of RAM the snapshots take on each node per GB of the job's train state, spread evenly over `nodes`."""
    return snapshot_bytes_needed(1, 1, replica, durable) / nodes


def _read_int(path: str) -> Optional[int]:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_memory_bytes() -> int:
    """The node's RAM, or the container's memory limit when lower (pages of a RAM file system count against it)."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limits = [_read_int(path) for path in _CGROUP_LIMITS]  # None for "max" (v2); v1's unlimited is a huge number
    return min([ram, *(limit for limit in limits if limit is not None)])


def ram_available_bytes() -> Optional[int]:
    """What the kernel can still give without swapping (MemAvailable), or the container's limit less its usage when
    that is lower. Pages of a RAM file system are not in it: they cannot be reclaimed."""
    free: Optional[int] = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    for limit_path, usage_path in zip(_CGROUP_LIMITS, _CGROUP_USAGE):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and free is not None and limit < (1 << 60):
            free = min(free, max(0, limit - usage))
    return free


def read_plan(folder: Path) -> int:
    """What the agent of run folder `folder` last planned for its node's snapshots (`PLAN_FILE`), 0 if nothing."""
    try:
        return int(json.loads((folder / PLAN_FILE).read_text())["needed"])
    except (OSError, ValueError, TypeError, KeyError):
        return 0


def _write_plan(folder: Path, needed: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{PLAN_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({"needed": needed}))
    os.replace(tmp, folder / PLAN_FILE)


def other_agents(folder: Path) -> list[OtherAgent]:
    """The other live agents' folders beside `folder` (an agent's run folder, `<run>-<pid>`) that plan or hold
    snapshots; none when `folder` is not named like one. A dead agent's folder is left to the sweep (its bytes are
    already out of the free space)."""
    if not RUN_FOLDER.match(folder.name):
        return []
    out = []
    for d in run_folders(folder.parent):
        m = RUN_FOLDER.match(d.name)
        if d == folder or not m or not psutil.pid_exists(int(m["pid"])):
            continue
        other = OtherAgent(path=d, planned=read_plan(d), held=bytes_held(d))
        if other.claim:
            out.append(other)
    return out


class _BaseLock:
    """An exclusive lock on the snapshot base for one check (no-op where the base cannot be written)."""

    def __init__(self, base: Path):
        self._path, self._fd = base / _LOCK_FILE, -1

    def __enter__(self) -> "_BaseLock":
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except OSError:
            self._fd = -1
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the lock


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
    """Raise ConfigError (not restartable) when this node's snapshots do not fit in the budget, in the free space
    under `folder` or in the host's free memory, each shared with the other agents on the host; otherwise record
    what this node needs (`PLAN_FILE`) and return the numbers (for a log line)."""
    with _BaseLock(folder.parent):
        plan = _plan(state_bytes_per_rank, local_ranks, budget, folder, replica, durable)
        _write_plan(folder, plan.needed)
    return plan


def _plan(state_bytes_per_rank: int, local_ranks: int, budget: Union[int, float, str, None],
          folder: Path, replica: bool, durable: bool) -> SnapshotBudget:
    needed = snapshot_bytes_needed(state_bytes_per_rank, local_ranks, replica, durable)
    others = tuple(other_agents(folder))
    limit, limit_from = resolve_budget(budget, folder)
    if budget is None and others:  # the default is the file system's share for every agent on it together
        claimed = sum(o.claim for o in others)
        limit = max(0, limit - claimed)
        limit_from += f", less {_human(claimed)} planned by {len(others)} other agent(s) on this host"
    pending = sum(o.pending for o in others)
    held = bytes_held(folder)
    fs = _statvfs(folder)
    available = max(0, fs.f_bavail * fs.f_frsize + held - pending)
    ram = ram_available_bytes()
    ram_free = None if ram is None else max(0, ram - pending)
    plan = SnapshotBudget(needed=needed, budget=limit, budget_from=limit_from, available=available,
                          ram_free=ram_free, others=others)
    ram_short = ram_free is not None and needed - held > ram_free
    if needed <= min(limit, available) and not ram_short:
        return plan
    own = SLOTS_PER_RANK + (DURABLE_SLOTS_PER_RANK if durable else 0)
    slots = f"({own} slots + a peer node's replica)" if replica else f"{own} slots"
    why = [f"{_FIELD} allows {limit} bytes ({_human(limit)}, {limit_from})"] if needed > limit else []
    fix = [f"raise {_FIELD}"] if needed > limit and not others else []
    if needed > available:
        why.append(f"the file system under {folder} has {_exact(available)} free")
        fix.insert(0, "give that file system more room (a bigger /dev/shm: docker run --shm-size, or a "
                      "Kubernetes emptyDir of medium Memory)")
    if ram_short:
        why.append(f"the host has {_exact(ram_free)} of memory free for the {_exact(max(0, needed - held))} not "
                   f"yet written (MemAvailable{', less what other agents planned' if pending else ''})")
        fix.insert(0, "free memory on the host")
    if others:
        why.append("other agents on this host plan " + ", ".join(f"{_human(o.claim)} ({o.path.name})"
                                                                 for o in others))
        fix.insert(0, "run fewer nodes or jobs per host")
    raise ConfigError(f"in-memory snapshots need {_exact(needed)} on this node ({slots} x {local_ranks} local "
                      f"rank(s) x {_human(state_bytes_per_rank)} of train state per rank) but {' and '.join(why)}; "
                      f"{' and '.join(fix)}, run fewer ranks per node, or turn snapshots off with "
                      f"checkpoint.snapshot_every_steps=0")


class SnapshotRoomError(OSError):
    """The node's snapshots do not fit any more: a worker restarted or re-formed in place at a smaller world (each
    rank's share of the train state grew), or the host's memory filled. The job goes on with the durable tier
    (`checkpoint_snapshot_failed`, then `checkpoint_snapshot_resumed` once they fit again); stopping a job that has
    trained, as at a fresh start, would lose more."""


def room_check(budget: Union[int, float, str, None], folder: Path, local_ranks: int,
               replica: bool, durable: bool = False, fatal: Callable[[], bool] = lambda: True
               ) -> Callable[[int], None]:
    """The check a `SnapshotStore` runs before it first reserves its slots (and when the state grows): raises
    `check_snapshot_budget`'s ConfigError when `fatal()` (a fresh start: the job stops with the message), else
    `SnapshotRoomError` (the snapshot is skipped and the check tried again at the next one); logs the numbers once
    when they fit."""
    def check(state_bytes_per_rank: int) -> None:
        try:
            plan = check_snapshot_budget(state_bytes_per_rank, local_ranks, budget, folder, replica, durable)
        except ConfigError as e:
            if fatal():
                raise
            raise SnapshotRoomError(str(e)) from None
        log.info("in-memory snapshots need %s on this node of %s allowed (%s), %s free, %s of memory free",
                 _human(plan.needed), _human(plan.budget), plan.budget_from, _human(plan.available),
                 "?" if plan.ram_free is None else _human(plan.ram_free))
    return check
