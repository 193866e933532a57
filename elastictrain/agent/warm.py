"""The torch side of pre-warmed spare workers: a process context that hands torch's workers to spares.

`torch_starts_workers_with` routes torch's worker start to it (a substitution: torch offers no seam; its
docstring says why). See `elastictrain.agent.spares` for the pool and `elastictrain.runtime.warmstart` for the
spare itself. The pool builds this context, so this module knows the pool only as `SpareSource`, the one method
it calls: the two modules do not import each other.
"""

from __future__ import annotations

import logging
import os
import signal
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Protocol

from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.multiprocessing.api import PContext, RunProcsResult, SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

from elastictrain.runtime.exitcodes import EXIT_REFORM
from elastictrain.runtime.warmstart import cold_command

log = logging.getLogger(__name__)

FAILED_GROUP_STOP_GRACE_S = 1.0
"""How long the survivors of a crashed worker get between SIGTERM and SIGKILL."""


class SpareSource(Protocol):
    """Where WarmContext gets its workers (`elastictrain.agent.spares.WarmPool`)."""

    def serve(self, local_rank: int, args: tuple, env: dict[str, str], stdout: Optional[str],
              stderr: Optional[str]) -> Optional[Any]:
        """Start one worker from a spare: a stand-in for torch's SubprocessHandler, or None to start it cold."""


def cold_args(entrypoint: Any, args: tuple) -> tuple:
    """The arguments of a worker started cold (no spare left): through the spares' module all the same, to leave as
    they do, its process groups destroyed before the interpreter's teardown (runtime/warmstart.py). Only under a
    Python interpreter: another entrypoint (a binary) starts as it is."""
    as_text = [str(a) for a in args]
    if not os.path.basename(str(entrypoint)).startswith("python"):
        return tuple(as_text)
    return tuple(cold_command(as_text))


class WarmContext(SubprocessContext):
    """torch's SubprocessContext whose processes come from a pool of spares where it can.

    It also stops the rest of a failed group fast. torch closes the group with SIGTERM and waits up to 30 s;
    after a peer crashed there is nothing left for a survivor to do (a collective save cannot finish, the next
    group reloads the last committed checkpoint, and a save cut short is never committed), yet unwinding
    out of a broken collective took 2-7 s here. Workers that all exited to re-form (a peer drained) keep
    the full timeout: the last of them may still be committing the drain's checkpoint.
    """

    def __init__(self, pool: SpareSource, **kwargs: Any):
        super().__init__(**kwargs)
        self._pool = pool
        self.keep_survivors = False
        """`elastic.in_place`: a failed worker's local peers stay up until the agent decides (torch stops them at
        once); the agent then replaces the failed ones (`replace`) or stops the rest (`close`)."""

    def _cold(self, local_rank: int) -> tuple:
        return cold_args(self.entrypoint, self.args[local_rank])

    def _poll(self) -> Optional[RunProcsResult]:
        if not self.keep_survivors:
            return super()._poll()
        done: set[int] = set()
        self._capture_process_failures(done)
        self._running_local_ranks.difference_update(done)
        if self._failures:
            return RunProcsResult(failures=dict(self._failures), stdouts=self.stdouts, stderrs=self.stderrs)
        return super()._poll() if not self._running_local_ranks else None

    def replace(self, local_rank: int, env: dict[str, str]) -> int:
        """Start a new process for failed `local_rank` (from a spare when one is left), with its environment plus
        `env`; the survivors keep running. Returns its pid."""
        stdout, stderr = self.stdouts[local_rank], self.stderrs[local_rank]
        full_env = {**self.envs[local_rank], **env}
        handler = self._pool.serve(local_rank, self.args[local_rank], full_env,
                                   str(stdout) if stdout else None, str(stderr) if stderr else None)
        if handler is None:
            handler = get_subprocess_handler(entrypoint=self.entrypoint, args=self._cold(local_rank), env=full_env,
                                             stdout=stdout, stderr=stderr, local_rank_id=local_rank,
                                             numa_options=self._numa_options)
        self.subprocess_handlers[local_rank] = handler
        self._failures.pop(local_rank, None)
        self._running_local_ranks.add(local_rank)
        return handler.proc.pid

    def close(self, death_sig: Optional[signal.Signals] = None, timeout: int = 30) -> None:
        failures = self._failures.values()
        if death_sig is None and failures and any(f.exitcode != EXIT_REFORM for f in failures):
            timeout = min(timeout, FAILED_GROUP_STOP_GRACE_S)  # type: ignore[assignment]
        super().close(death_sig, timeout)

    def _start(self) -> None:
        if self.subprocess_handlers:
            raise ValueError("the worker processes were already started")
        handlers: dict[int, Any] = {}
        for local_rank in range(self.nprocs):
            stdout, stderr = self.stdouts[local_rank], self.stderrs[local_rank]
            handler = self._pool.serve(local_rank, self.args[local_rank], self.envs[local_rank],
                                       str(stdout) if stdout else None, str(stderr) if stderr else None)
            if handler is None:
                handler = get_subprocess_handler(entrypoint=self.entrypoint, args=self._cold(local_rank),
                                                 env=self.envs[local_rank], stdout=stdout, stderr=stderr,
                                                 local_rank_id=local_rank, numa_options=self._numa_options)
            handlers[local_rank] = handler
        self.subprocess_handlers = handlers


@contextmanager
def torch_starts_workers_with(start: Callable[..., PContext]) -> Iterator[None]:
    """Within the block, torch's ``LocalElasticAgent._start_workers`` starts its workers through `start`.

    A substitution, because torch (2.13) offers no seam for it. ``_start_workers`` builds every worker's
    environment inline (RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*, LOCAL_RANK or CUDA_VISIBLE_DEVICES,
    OMP_NUM_THREADS, the args' ${local_rank} macro, log-line prefixes) and, in the same method, calls the
    module-level ``start_processes`` that local_elastic_agent imported by name. No method returns that environment
    or creates the process context; the overridable methods it calls (``_set_local_rank_env``,
    ``_setup_local_watchdog(envs)``, ``_setup_healthcheck``) run before the start and cannot replace it;
    ``start_processes`` takes no context class (a binary entrypoint always gets ``SubprocessContext``, whose
    processes come from the module-level ``get_subprocess_handler``); and the one object the agent is given,
    ``LogsSpecs``, only chooses log files. The alternative, building the PContext ourselves, means copying
    that environment construction, which changes between torch releases. So the one call is replaced for the
    length of the block and restored after it, on error too; only the agent's run loop starts workers, so
    nothing else sees the replacement. tests/unit/agent/test_warm.py fails when torch stops calling it.
    """
    called = False

    def start_and_note(**kwargs: Any) -> PContext:
        nonlocal called
        called = True
        return start(**kwargs)

    torch_start = local_elastic_agent.start_processes
    local_elastic_agent.start_processes = start_and_note
    try:
        yield
    finally:
        local_elastic_agent.start_processes = torch_start
    if not called:
        log.warning("torch started the workers without local_elastic_agent.start_processes: spares and the fast "
                    "stop of a crashed group are off. Pin torch to a tested version or pass --no-warm-spares")
