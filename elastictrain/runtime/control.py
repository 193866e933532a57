"""Operator control inside a worker: pause/resume and "checkpoint now", relayed by the node's agent.

Workers never talk to etcd for control (a per-step etcd read from every rank would not scale). The agent watches
the control keys and writes the wanted state to a small local file (`ELASTICTRAIN_CONTROL_FILE`), then rings a
doorbell (SIGUSR1). The worker reads the file only after the doorbell, at its next step boundary, and the
recipe's per-step all_reduce turns the local wishes into one decision shared by every rank:

* pause: any rank asks -> all ranks pause together at the same step; they resume when no rank asks any more.
* checkpoint now: only global rank 0's wish counts, so a request is saved exactly once, whichever agent saw it first.
* re-form: any rank asks -> every rank stops at the same step boundary, saves, and exits for the agents to re-form
  the group with fresh worker processes (how the agent replaces a straggling rank: `elastic.replace_stragglers`).

SIGUSR1's default action kills a process: the handler is installed first thing in the worker, and the agent
rings only workers that have already sent a heartbeat (which they do after installing it).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import asdict, dataclass
from typing import Any, Optional

log = logging.getLogger(__name__)

ENV_CONTROL_FILE = "ELASTICTRAIN_CONTROL_FILE"
DOORBELL = signal.SIGUSR1
"""Sent by the agent after it rewrote the control file."""


@dataclass
class ControlState:
    """What the operator wants from this node's workers (the file's content)."""

    paused: bool = False
    ckpt_seq: int = 0
    """Id of the newest "checkpoint now" request; a higher value than the last handled one is a new request."""
    reform_seq: int = 0
    """Id of the newest re-form request, read like `ckpt_seq`."""

    @classmethod
    def read(cls, path: str) -> "ControlState":
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as e:  # a torn write cannot happen (rename), a bad file can: ignore it
            log.warning("ignoring unreadable control file %s: %s", path, e)
            return cls()
        return cls(paused=bool(raw.get("paused", False)), ckpt_seq=int(raw.get("ckpt_seq", 0)),
                   reform_seq=int(raw.get("reform_seq", 0)))

    def write(self, path: str) -> None:
        """Atomic replace, so that a worker never reads half a file."""
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(self), f)
        os.replace(tmp, path)


class WorkerControl:
    """The worker's view of the control file; `poll()` at step boundaries is free unless the doorbell rang."""

    def __init__(self, path: Optional[str]):
        self.path = path
        self._rang = False
        self.state = ControlState.read(path) if path else ControlState()
        # A request made before this worker started was meant for the previous group: do not replay it.
        self._ckpt_done = self.state.ckpt_seq
        self._reform_done = self.state.reform_seq

    @classmethod
    def from_env(cls) -> "WorkerControl":
        """Install the doorbell handler (first: see the module doc) and read the current state."""
        path = os.environ.get(ENV_CONTROL_FILE)
        ctl = cls(path)
        if path:
            signal.signal(DOORBELL, ctl._ring)
        return ctl

    def _ring(self, signum: int, frame: Any) -> None:
        self._rang = True

    def close(self) -> None:
        """Stop listening; a doorbell that comes later is ignored. The agent rings a worker once after its first
        heartbeat, which for a short run can be as the process exits, and the interpreter's finalization puts
        SIGUSR1's default action back: it killed workers that had finished and saved (exit -10, after which the
        agents restarted the group at its end). An ignored signal stays ignored through finalization."""
        if self.path and signal.getsignal(DOORBELL) == self._ring:
            try:
                signal.signal(DOORBELL, signal.SIG_IGN)
            except ValueError:  # not the main thread: the handler stays, and so does the risk
                log.debug("could not ignore the doorbell from this thread")

    def poll(self) -> None:
        if self._rang and self.path:
            self._rang = False
            self.state = ControlState.read(self.path)

    @property
    def paused(self) -> bool:
        return self.state.paused

    @property
    def ckpt_requested(self) -> bool:
        return self.state.ckpt_seq > self._ckpt_done

    @property
    def reform_requested(self) -> bool:
        """The agent asked this node's workers to stop for a re-form (no need to mark it handled: they exit)."""
        return self.state.reform_seq > self._reform_done

    def ckpt_handled(self) -> None:
        self._ckpt_done = max(self._ckpt_done, self.state.ckpt_seq)
