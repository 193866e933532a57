"""Pre-warmed spare workers for the agent (the worker side is `elastictrain.runtime.warmstart`).

This module imports no torch, so that `elastictrain run` can start its spares before it imports torch itself
(`start_early`); `agent/warm.py` holds the torch side (the process context that hands spares to torch).

A restart spends most of its time starting new worker processes. The pool keeps one idle spare per local rank
that has already imported the worker's code; torch's ``start_processes`` is served from the pool, so a restart
costs the rendezvous, process-group set-up and checkpoint load, not the imports. Spares are started when the
agent starts (they become the first workers, so nothing is imported twice) and refilled once the new group is
training, so that refilling never competes with a group's start-up for CPU.

Each spare is an idle Python process with torch imported: about 350 MB of host memory per local rank on CPU,
no GPU memory (CUDA is first touched after the assignment).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any, Optional, Sequence

from elastictrain.runtime.warmstart import ENV_WARM_DIR, MODULE, parse_command, rank_file, ready_file

log = logging.getLogger(__name__)

_CLOSE_WAIT_S = 2.0

RECIPE_MODULE = "elastictrain.recipes.lm"
"""The worker module `elastictrain run` starts."""


class Spare:
    """One idle pre-warmed process, the agent's child."""

    def __init__(self, entrypoint: str, args: Sequence[str], env: dict[str, str]):
        target = parse_command(args)
        flags = ["-u"] if target.unbuffered else []
        self.proc = subprocess.Popen([entrypoint, *flags, "-m", MODULE, *args], stdin=subprocess.PIPE, env=env,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def assign(self, env: dict[str, str], args: Sequence[str], stdout: Optional[str], stderr: Optional[str]) -> None:
        line = json.dumps({"env": env, "args": [str(a) for a in args], "stdout": stdout, "stderr": stderr})
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.close()

    def dismiss(self) -> None:
        """End of input: an idle spare exits on its own."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


class SpareHandler:
    """Stands in for torch's SubprocessHandler around a spare that became a worker."""

    def __init__(self, spare: Spare, local_rank: int):
        self.proc = spare.proc
        self.local_rank_id = local_rank

    def close(self, death_sig: Optional[signal.Signals] = None) -> None:
        try:
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)
        except ProcessLookupError:
            pass


class WarmPool:
    """Up to `size` idle spares for one worker command (entrypoint + args)."""

    def __init__(self, entrypoint: str, args: Sequence[str], size: int):
        self.entrypoint, self.args, self.size = entrypoint, [str(a) for a in args], size
        self.dir = tempfile.mkdtemp(prefix="elastictrain-warm-")
        self._spares: list[Spare] = []
        self.served = 0
        self.cold = 0

    def fill(self) -> int:
        """Start spares until `size` are alive; returns how many were started."""
        self._spares = [s for s in self._spares if s.alive()]
        while len(self._spares) > self.size:
            self._spares.pop().dismiss()
        env = {**os.environ, ENV_WARM_DIR: self.dir}
        started = 0
        while len(self._spares) < self.size:
            try:
                self._spares.append(Spare(self.entrypoint, self.args, env))
            except OSError as e:
                log.warning("cannot start a spare worker (%s); restarts will start workers cold", e)
                break
            started += 1
        if started:
            log.debug("started %d spare worker(s)", started)
        return started

    def alive(self) -> int:
        """How many idle spares are alive (a spare whose import failed has exited)."""
        return sum(1 for s in self._spares if s.alive())

    def ready(self) -> int:
        """How many idle spares have finished their imports."""
        return sum(1 for s in self._spares if s.alive() and os.path.exists(ready_file(self.dir, s.proc.pid)))

    def take(self) -> Optional[Spare]:
        while self._spares:
            spare = self._spares.pop(0)
            if spare.alive():
                return spare
        return None

    def start_processes(self, *, name: str, entrypoint: Any, args: dict[int, tuple], envs: dict[int, dict[str, str]],
                        logs_specs: Any, log_line_prefixes: Optional[dict[int, str]] = None,
                        start_method: str = "spawn",
                        numa_options: Any = None, duplicate_stdout_filters: Optional[list[str]] = None,
                        duplicate_stderr_filters: Optional[list[str]] = None) -> Any:
        """torch's ``start_processes`` for a binary entrypoint, served from the pool (cold when it is empty)."""
        # Imported here: warm.py imports torch, and this module is imported before torch (see its docstring).
        from elastictrain.agent.warm import WarmContext

        ctx = WarmContext(self, name=name, entrypoint=entrypoint, args=args, envs=envs, logs_specs=logs_specs,
                          log_line_prefixes=log_line_prefixes, numa_options=numa_options,
                          duplicate_stdout_filters=duplicate_stdout_filters,
                          duplicate_stderr_filters=duplicate_stderr_filters)
        ctx.start()
        return ctx

    def serve(self, local_rank: int, args: tuple, env: dict[str, str], stdout: Optional[str],
              stderr: Optional[str]) -> Optional[SpareHandler]:
        """Hand a worker's assignment to a spare; None when none is left (the caller starts one cold)."""
        # Any spare will do: it runs the assignment's arguments (a per-rank ${local_rank} macro, another config);
        # the ones it was started with only chose what to import ahead.
        spare = self.take() if self.size else None
        if spare is None:
            self.cold += 1
            return None
        full_env = {**os.environ, **env, ENV_WARM_DIR: self.dir}
        with open(rank_file(self.dir, spare.proc.pid), "w") as f:
            f.write(str(env.get("RANK", "")))
        try:
            spare.assign(full_env, args, stdout, stderr)
        except OSError as e:  # it died between the check and the write
            log.warning("spare worker %d is gone (%s); starting local rank %d cold", spare.proc.pid, e, local_rank)
            self.cold += 1
            return None
        self.served += 1
        return SpareHandler(spare, local_rank)

    def close(self) -> None:
        """Dismiss the idle spares (they exit on end of input), kill any that linger; remove the pool's files."""
        spares, self._spares = self._spares, []
        for s in spares:
            s.dismiss()
        for s in spares:
            try:
                s.proc.wait(timeout=_CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(s.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                s.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_early(run_argv: Sequence[str]) -> Optional[WarmPool]:
    """Start the spares of ``elastictrain run RUN_ARGV`` now, before this process imports torch.

    Importing torch and the agent takes seconds; the spares' own imports then run alongside instead of after.
    None when the command line or config turns spares off or cannot be read (the run itself then reports why).
    """
    from elastictrain.config import load_config
    from elastictrain.errors import ElastictrainError

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--nproc-per-node", "--nproc_per_node")
    p.add_argument("--no-warm-spares", action="store_true")
    try:
        args, _ = p.parse_known_args(list(run_argv))
        if not args.config or args.no_warm_spares:
            return None
        cfg = load_config(args.config, args.overrides)
    except (SystemExit, ElastictrainError, OSError):
        return None
    if not cfg.elastic.warm_spares:
        return None
    nproc = args.nproc_per_node
    size = int(nproc) if nproc and nproc.isdigit() else cfg.elastic.nproc_per_node
    worker = ["-u", "-m", RECIPE_MODULE, "--config", args.config]
    for o in args.overrides:
        worker += ["--set", o]
    pool = WarmPool(os.getenv("PYTHON_EXEC", sys.executable), worker, size)
    pool.fill()
    return pool
