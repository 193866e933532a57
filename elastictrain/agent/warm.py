"""The torch side of pre-warmed spare workers: a process context that hands torch's workers to spares.

See `elastictrain.agent.spares` for the pool and `elastictrain.runtime.warmstart` for the spare itself. The pool
builds this context, so this module knows the pool only as `SpareSource`, the one method it calls: the two
modules do not import each other.
"""

from __future__ import annotations

import signal
from typing import Any, Optional, Protocol

from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

from elastictrain.runtime.exitcodes import EXIT_REFORM

FAILED_GROUP_STOP_GRACE_S = 1.0
"""How long the survivors of a crashed worker get between SIGTERM and SIGKILL."""


class SpareSource(Protocol):
    """Where WarmContext gets its workers (`elastictrain.agent.spares.WarmPool`)."""

    def serve(self, local_rank: int, args: tuple, env: dict[str, str], stdout: Optional[str],
              stderr: Optional[str]) -> Optional[Any]:
        """Start one worker from a spare: a stand-in for torch's SubprocessHandler, or None to start it cold."""


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
                handler = get_subprocess_handler(entrypoint=self.entrypoint, args=self.args[local_rank],
                                                 env=self.envs[local_rank], stdout=stdout, stderr=stderr,
                                                 local_rank_id=local_rank, numa_options=self._numa_options)
            handlers[local_rank] = handler
        self.subprocess_handlers = handlers
