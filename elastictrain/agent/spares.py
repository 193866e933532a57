"""Pre-warmed spare workers for the agent (the worker side is `elastictrain.runtime.warmstart`).

This module imports no torch, so that `elastictrain run` can start its spares before it imports torch itself
(`start_early`); `agent/warm.py` holds the torch side (the process context that hands spares to torch).

A restart spends most of its time starting new worker processes. The pool keeps one idle spare per local rank
that has already imported the worker's code; torch's ``start_processes`` is served from the pool, so a restart
costs the rendezvous, process-group set-up and checkpoint load, not the imports. Spares are started when the
agent starts (they become the first workers, so nothing is imported twice) and refilled once the new group made its
first step, so that refilling never competes with a group's start-up, load and first step for CPU (not at all when
the job is about to end; see the agent's `_maybe_refill`).

Each spare is an idle Python process with torch imported: about 350 MB of host memory per local rank on CPU,
no GPU memory (CUDA is first touched after the assignment).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from elastictrain.agent.scratch import make_scratch_dir
from elastictrain.runtime.warmstart import (
    ENV_IMPORT_NICE,
    ENV_PREWARM,
    ENV_WARM_DIR,
    MODULE,
    parse_command,
    rank_file,
    ready_file,
)

log = logging.getLogger(__name__)

RECIPE_MODULE = "elastictrain.recipes.lm"
"""The worker module `elastictrain run --config job.yaml` starts when no script is given."""

SCRIPT_PREWARM = ("torch", "torch.distributed", "elastictrain.runtime.worker")
"""What the spares of a user's script (or module) import ahead, besides `--prewarm`: torch's distributed stack, and
the public worker API with its checkpoint stack (DCP, fsspec), which a script on the API imports anyway."""

FLAGS_WITHOUT_VALUE = frozenset({
    "-h", "--help", "--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path",
    "--virtual-local-rank", "--virtual_local_rank", "--no-warm-spares", "--expect-heartbeats",
    "--no-expect-heartbeats"})
"""`elastictrain run`'s flags (torchrun's and ours) that take no value: where the script starts, without torch."""


@dataclass
class RunArgs:
    """``elastictrain run`` argv split torch-free: our config sources, launcher flags, and the worker's target."""

    config: Optional[str] = None
    overrides: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    """torchrun's and our launcher flags, in order, `-m` taken out."""
    module: bool = False
    target: Optional[str] = None
    """The user's script (or module with `-m`); None: the recipe, trained from `--config`."""
    target_args: list[str] = field(default_factory=list)

    @classmethod
    def split(cls, argv: Sequence[str]) -> "RunArgs":
        """Split at the first positional argument: everything after it belongs to the script, like torchrun."""
        run, argv, i = cls(), [str(a) for a in argv], 0
        while i < len(argv) and argv[i].startswith("-"):
            name, has_value = argv[i].split("=", 1)[0], "=" in argv[i]
            value = argv[i].split("=", 1)[1] if has_value else (argv[i + 1] if i + 1 < len(argv) else None)
            step = 1 if has_value or name in FLAGS_WITHOUT_VALUE else 2
            if name == "--config":
                run.config = value
            elif name == "--set":
                run.overrides.append(str(value))
            elif name in ("-m", "--module"):
                run.module = True
            else:
                run.flags += argv[i:i + step]
            i += step
        if i < len(argv):
            run.target, run.target_args = argv[i], argv[i + 1:]
        return run

    def flag(self, *names: str) -> Optional[str]:
        """The last value given to a launcher flag (``--x v`` or ``--x=v``), None when absent."""
        found = None
        for i, a in enumerate(self.flags):
            name, _, value = a.partition("=")
            if name in names:
                found = value if "=" in a else (self.flags[i + 1] if i + 1 < len(self.flags) else None)
        return found

    def worker_args(self) -> list[str]:
        """The interpreter arguments of a worker, as torchrun builds them (`-u`, then the target)."""
        if self.target is None:
            sets = [x for o in self.overrides for x in ("--set", o)]
            return ["-u", "-m", RECIPE_MODULE, "--config", str(self.config), *sets]
        return ["-u", *(["-m"] if self.module else []), self.target, *self.target_args]

    def prewarm(self, extra: Sequence[str]) -> list[str]:
        """Modules a spare imports before it waits: `--prewarm`'s, and torch's for a user's script or module."""
        own = self.flag("--prewarm")
        listed = [m.strip() for m in (own.split(",") if own is not None else extra) if m.strip()]
        base = [] if self.target is None else list(SCRIPT_PREWARM)
        return list(dict.fromkeys([*base, *listed]))


REFILL_NICE = 19
"""How much lower a refilled spare's CPU priority is while it imports (`warmstart.import_nicely`). Its imports are
several CPU-seconds (torch, transformers, the recipe): at normal priority on a node whose cores the workers use they
slowed the 2-3 steps after each recovery (goodput.py at 50M on 2 cores: steps of 2.6 s took 3.2-3.9 s); at nice 19
they take the cores the workers leave idle (same benchmark at 50M, before/after, 2 rounds: 3-8 % more useful steps
per second under faults; not shown at the tiny model, where the runs' fault-free pace differed more). The imports
also run under SCHED_IDLE (`warmstart.import_nicely`): at nice 19 alone the tiny model's steps still ran at half pace
for each refill's imports, its worker waking once per collective behind the spare's slice. A fault before
they finish: the spare is assigned anyway, back at normal priority, and finishes its imports then."""


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

    def kill(self) -> None:
        """SIGKILL the spare's process group (its own session: the spare and anything it started)."""
        if self.proc.poll() is not None:  # exited and reaped: its pid may be another process's by now
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

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

    def __init__(self, entrypoint: str, args: Sequence[str], size: int, prewarm: Sequence[str] = ()):
        self.entrypoint, self.args, self.size = entrypoint, [str(a) for a in args], size
        self.prewarm = list(prewarm)
        self.dir = make_scratch_dir("warm")
        self._spares: list[Spare] = []
        self.served = 0
        self.cold = 0

    def fill(self, while_training: bool = False) -> int:
        """Start spares until `size` are alive; returns how many were started. `while_training`: a refill beside a
        running group, whose imports run at `REFILL_NICE` where the spare can restore its priority when assigned."""
        self._spares = [s for s in self._spares if s.alive()]
        while len(self._spares) > self.size:
            self._spares.pop().dismiss()
        env = {**os.environ, ENV_WARM_DIR: self.dir, ENV_PREWARM: ",".join(self.prewarm)}
        if while_training:
            env[ENV_IMPORT_NICE] = str(REFILL_NICE)
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
        """SIGKILL the idle spares and reap them; remove the pool's files.

        An idle spare holds nothing worth a clean exit, and one still importing reads its end of input only once
        its imports are done: dismissing and waiting for them held every agent's exit up to 2 s per spare.
        """
        spares, self._spares = self._spares, []
        for s in spares:
            s.kill()
        for s in spares:
            s.proc.wait()
            s.dismiss()  # closes our end of its input pipe
        shutil.rmtree(self.dir, ignore_errors=True)


def start_early(run_argv: Sequence[str]) -> Optional[WarmPool]:
    """Start the spares of ``elastictrain run RUN_ARGV`` now, before this process imports torch.

    Importing torch and the agent takes seconds; the spares' own imports then run alongside instead of after.
    None when the command line or config turns spares off or cannot be read (the run itself then reports why).
    """
    from elastictrain.config import load_config, load_elastic
    from elastictrain.errors import ElastictrainError
    from elastictrain.runtime.allocator import worker_huge_pages_env

    run = RunArgs.split(run_argv)
    if {"--no-warm-spares", "-h", "--help"} & set(run.flags) or (run.target is None and not run.config):
        return None
    try:
        if run.target is None:
            elastic = load_config(run.config, run.overrides).elastic
        else:
            elastic = load_elastic(run.config, run.overrides)
    except (ElastictrainError, OSError):
        return None
    if not elastic.warm_spares:
        return None
    # torch reads its huge-page switch as it loads, which a spare does now: the agent's own setting comes too late.
    os.environ.update(worker_huge_pages_env(elastic.worker_huge_pages, os.environ))
    nproc = run.flag("--nproc-per-node", "--nproc_per_node")
    size = int(nproc) if nproc and nproc.isdigit() else elastic.nproc_per_node
    pool = WarmPool(os.getenv("PYTHON_EXEC", sys.executable), run.worker_args(), size, run.prewarm(elastic.prewarm))
    pool.fill()
    return pool
