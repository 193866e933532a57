"""Signals to a launcher's processes on one machine, by PID: find its workers, kill or stop them, kill or drain it.

The building blocks of the chaos runner's process faults (:mod:`elastictrain.chaos.injectors`, which add what a
schedule needs: choosing a worker, healing), also used directly by tests and benchmarks.

A *node* is a launcher process (``elastictrain run`` or stock ``torchrun``) started in its own session, plus its
workers. Workers of both launchers lead sessions of their own, so killing a node's process group alone would
leave them running: ``kill_node`` signals both.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

import psutil

from elastictrain.runtime.warmstart import assigned_rank

WORKER_MODULE = "elastictrain.recipes.lm"


def worker_pids(launcher_pid: int, module: str = WORKER_MODULE) -> dict[int, int]:
    """Global rank -> pid of the live training workers below a launcher process."""
    out: dict[int, int] = {}
    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for p in children:
        try:
            if module in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                rank = assigned_rank(p.pid, p.environ())  # an idle pre-warmed spare has none yet
                if rank is not None:
                    out[rank] = p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            continue
    return out


def signal_worker(launcher_pid: int, sig: signal.Signals, rank: Optional[int] = None) -> int:
    """Send `sig` to one worker of the launcher (rank `rank`, else its lowest rank); returns the worker's pid."""
    pids = worker_pids(launcher_pid)
    if not pids:
        raise LookupError(f"launcher {launcher_pid} has no live workers")
    pid = pids[rank] if rank is not None else pids[min(pids)]
    os.kill(pid, sig)
    return pid


def kill_node(launcher_pid: int) -> list[int]:
    """SIGKILL a whole node: the launcher's process group and every process below it (power-off-like).

    The group is signalled only when the launcher leads it: a launcher started from a shell without a session of
    its own shares the shell's group (and maybe ours), which must survive."""
    victims = list(worker_pids(launcher_pid).values())
    try:
        victims += [p.pid for p in psutil.Process(launcher_pid).children(recursive=True) if p.pid not in victims]
    except psutil.NoSuchProcess:
        pass
    try:
        if os.getpgid(launcher_pid) == launcher_pid:
            os.killpg(launcher_pid, signal.SIGKILL)
        else:
            os.kill(launcher_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    return [launcher_pid, *victims]


def drain_node(launcher_pid: int) -> None:
    """SIGTERM the launcher only (an operator's or scheduler's graceful stop); it tells its workers."""
    os.kill(launcher_pid, signal.SIGTERM)
