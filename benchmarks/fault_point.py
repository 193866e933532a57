"""Where a benchmark's fault lands: a fixed number of steps past the newest committed checkpoint.

A kill or a hang costs the steps completed since the newest committed checkpoint, so systems compared on steps
lost (or on anything that includes recomputing them) must be faulted at the same offset from it. The victims are
looked up before that wait ("armed"): walking the process tree when the fault fires takes tens of ms under load,
long enough for another step to finish.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Protocol

import psutil

from elastictrain.chaos.process_signals import worker_pids
from elastictrain.checkpoint.manifest import MARKER_NAME, parse_step_dir


class Progress(Protocol):
    """What `at_offset` reads (recovery.py's `LedgerWatch`)."""

    def poll(self) -> None:
        """Read the progress made since the last read."""

    def newest(self) -> Any:
        """The newest step every rank of the running group completed (`.step`, 0-based), or None."""


def committed_step(ckpt_dir: Path) -> Optional[int]:
    """The step of the newest checkpoint under `ckpt_dir` with a commit marker: where a restart resumes."""
    steps = (parse_step_dir(m.parent.name) for m in ckpt_dir.glob(f"step-*/{MARKER_NAME}"))
    return max((s for s in steps if s is not None), default=None)


def steps_since_checkpoint(newest_step: int, ckpt_step: Optional[int]) -> Optional[int]:
    """Steps a fault at this point costs: ledger steps are 0-based and checkpoint N holds steps 0..N-1."""
    return None if ckpt_step is None else newest_step + 1 - ckpt_step


def at_offset(progress: Progress, ckpt_dir: Path, offset: int, alive: Callable[[], bool],
              timeout: float = 120.0) -> tuple[Any, dict]:
    """Wait until the running group completed exactly `offset` steps past the newest committed checkpoint.

    Returns the newest completed step and where a fault fired at once lands (`ckpt_step`, `fault_step`,
    `fault_offset`). Progress is read every 2 ms (a step takes tens of ms), so the offset is seen within its step;
    one first seen past `offset` (a step missed, a commit not visible yet) waits for the same offset in the next
    interval rather than firing elsewhere. AssertionError after `timeout`, or once `alive()` is False.
    """
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline and alive():
        progress.poll()
        newest = progress.newest()
        if newest is not None and newest is not seen:
            seen, ckpt = newest, committed_step(ckpt_dir)
            if steps_since_checkpoint(newest.step, ckpt) == offset:
                return newest, {"ckpt_step": ckpt, "fault_step": newest.step + 1, "fault_offset": offset}
        time.sleep(0.002)
    raise AssertionError(f"never saw {offset} steps completed past a committed checkpoint within {timeout:.0f} s")


def arm_worker_signal(launcher_pid: int, sig: signal.Signals) -> Callable[[], None]:
    """Sending `sig` to the launcher's lowest-rank worker (as `chaos.process_signals.signal_worker`), looked up now."""
    pids = worker_pids(launcher_pid)
    assert pids, f"launcher {launcher_pid} has no live workers"
    return lambda: os.kill(pids[min(pids)], sig)


def arm_node_kill(launcher_pid: int) -> Callable[[], None]:
    """SIGKILL of the launcher's process group and every process below it (as `chaos.process_signals.kill_node`: workers
    and spares lead sessions of their own), looked up now. The launcher must lead its process group."""
    workers = list(worker_pids(launcher_pid).values())
    assert workers, f"launcher {launcher_pid} has no live workers"
    below = [p.pid for p in psutil.Process(launcher_pid).children(recursive=True) if p.pid not in workers]

    def fire() -> None:
        os.killpg(launcher_pid, signal.SIGKILL)
        for pid in [*workers, *below]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
    return fire
