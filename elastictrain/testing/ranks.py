"""One OS process per rank, for the multi-process tests and benchmarks: started, waited for with one deadline for
all, and stopped by PID (SIGKILL) if still running then."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path


def run_ranks(argv: Callable[[int], list[str]], world: int, out: Path, timeout_s: float,
              env: Mapping[str, str] | None = None, cwd: Path | None = None) -> list[int]:
    """Run `argv(rank)` for each rank at once, each one's output in `out/rank<r>.log`; the exit codes (-9 for a rank
    killed at the deadline, `timeout_s` after the start)."""
    procs = []
    for r in range(world):
        with open(out / f"rank{r}.log", "wb") as log:
            procs.append(subprocess.Popen(argv(r), cwd=cwd, env=None if env is None else dict(env), stdout=log,
                                          stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    return [p.returncode for p in procs]
