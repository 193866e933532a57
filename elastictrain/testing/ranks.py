"""One OS process per rank, for the multi-process tests and benchmarks: started, waited for with one deadline for
all, and stopped by PID (SIGKILL) if still running then."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


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


WORKER_FLAG = "--worker"


def run_worker_script(script: str, work: Path, world: int, args: dict[str, Any], timeout_s: float,
                      env: Mapping[str, str] | None = None, cwd: Path | None = None) -> list[dict[str, Any]]:
    """Run `python script --worker <rank> <world> <port> <work/args.json>` once per rank (the group on one free
    loopback port), each writing `work/result-<rank>.json` (`worker_entry`): the ranks' results, or RuntimeError
    naming the rank that failed, with its log's tail."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "args.json").write_text(json.dumps(args))
    with socket.socket() as sock:  # a free loopback port for the group (the lowest layer: no rendezvous import)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    codes = run_ranks(lambda r: [sys.executable, script, WORKER_FLAG, str(r), str(world), str(port),
                                 str(work / "args.json")], world, work, timeout_s, env=env, cwd=cwd)
    for r, code in enumerate(codes):
        if code != 0:
            tail = (work / f"rank{r}.log").read_text()[-4000:]
            raise RuntimeError(f"rank {r} exited {code}:\n{tail}")
    return [json.loads((work / f"result-{r}.json").read_text()) for r in range(world)]


def worker_entry(worker: Callable[[int, int, int, dict[str, Any]], dict[str, Any]],
                 argv: list[str] | None = None) -> bool:
    """In a script that `run_worker_script` runs: with `--worker` arguments, run `worker(rank, world, port, args)`
    and write its result where that function reads it; whether it ran (else the script does its own main)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != WORKER_FLAG:
        return False
    rank, world, port, args_path = int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    result = worker(rank, world, port, json.loads(args_path.read_text()))
    args_path.with_name(f"result-{rank}.json").write_text(json.dumps(result))
    return True
