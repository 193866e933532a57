"""Worker side of agent health: progress heartbeats to the local agent, and dying with the agent.

Channel: one unix datagram socket per agent (path in ``ELASTICTRAIN_HEARTBEAT_ADDR``), shared by all of
its local workers. A datagram is atomic (no torn reads, unlike a shared file), the socket is non-blocking
so a slow or dead agent can never stall a training step (a full queue or a missing socket drops the beat),
and there is nothing per worker to create or clean up. A send costs a few microseconds; beats closer than
``min_interval_s`` are skipped unless the phase changes, so calling ``beat`` every step costs well under a
microsecond in the common case. The agent needs progress, not every step: it derives step time from
(time, step) deltas between the beats it does receive.

The socket path lives in a 0700 directory made by the agent, so other users cannot spoof beats.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENV_HEARTBEAT_ADDR = "ELASTICTRAIN_HEARTBEAT_ADDR"
"""Path of the agent's unix datagram socket; set by the agent for its workers."""
ENV_AGENT_PID = "ELASTICTRAIN_AGENT_PID"
"""PID of the agent that started this worker; the worker dies with it."""
ENV_HEARTBEAT_MIN_INTERVAL = "ELASTICTRAIN_HEARTBEAT_MIN_INTERVAL"
"""Optional override of ``DEFAULT_MIN_INTERVAL_S`` (seconds)."""

DEFAULT_MIN_INTERVAL_S = 0.05
"""Beats within this interval of the last sent one are skipped (phase changes are always sent)."""

# "done": the training loop is over (final save, summary, process-group teardown): no more steps to judge by.
PHASES: tuple[str, ...] = ("init", "load", "train", "save", "paused", "done")
_PHASE_CODE = {p: i for i, p in enumerate(PHASES)}

_WIRE_VERSION = 1
# version, phase, local_rank, pid, step, worker monotonic time
_WIRE = struct.Struct("<BBHiqd")

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Beat:
    """One heartbeat: a worker's progress report as it crosses the process boundary."""

    local_rank: int
    pid: int
    step: int
    phase: str
    time: float
    """The worker's ``time.monotonic()``: CLOCK_MONOTONIC is system-wide on Linux, so the agent can compare it."""

    def pack(self) -> bytes:
        return _WIRE.pack(_WIRE_VERSION, _PHASE_CODE[self.phase], self.local_rank, self.pid, self.step, self.time)

    @classmethod
    def unpack(cls, data: bytes) -> Beat:
        """Decode a datagram; raises ValueError on anything that is not a beat of this wire version."""
        if len(data) != _WIRE.size:
            raise ValueError(f"heartbeat datagram has {len(data)} bytes, expected {_WIRE.size}")
        version, phase, local_rank, pid, step, t = _WIRE.unpack(data)
        if version != _WIRE_VERSION or phase >= len(PHASES):
            raise ValueError(f"heartbeat datagram of unknown version {version} or phase code {phase}")
        return cls(local_rank=local_rank, pid=pid, step=step, phase=PHASES[phase], time=t)


class Heartbeat:
    """Emits (step, phase) progress to the agent; a no-op when the worker was not started by our agent."""

    def __init__(self, addr: str | None, local_rank: int = 0, min_interval_s: float = DEFAULT_MIN_INTERVAL_S):
        self._addr = addr
        self._local_rank = local_rank
        self._min_interval = min_interval_s
        self._last_sent = float("-inf")
        self._last_phase = ""
        self._sock: socket.socket | None = None
        self._warned = False
        if addr is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    @classmethod
    def from_env(cls) -> Heartbeat:
        """Build from the agent's env vars and tie this process's life to the agent's.

        Without ``ELASTICTRAIN_HEARTBEAT_ADDR`` (plain torchrun, a notebook) the emitter is a no-op.
        Sends a first ``beat(0, "init")``, which ends the agent's startup allowance: call it early in
        the worker, before process-group init and model building.
        """
        agent_pid = os.environ.get(ENV_AGENT_PID)
        if agent_pid:
            die_with_parent(int(agent_pid))
        addr = os.environ.get(ENV_HEARTBEAT_ADDR) or None
        interval = float(os.environ.get(ENV_HEARTBEAT_MIN_INTERVAL, DEFAULT_MIN_INTERVAL_S))
        hb = cls(addr, local_rank=int(os.environ.get("LOCAL_RANK", 0)), min_interval_s=interval)
        hb.beat(0, "init")
        return hb

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def beat(self, step: int, phase: str = "train") -> None:
        """Report progress: ``step`` is the global step, ``phase`` one of init/load/train/save/paused/done."""
        if self._sock is None:
            return
        if phase not in _PHASE_CODE:
            raise ValueError(f"heartbeat phase {phase!r} is not one of {', '.join(PHASES)}")
        now = time.monotonic()
        if phase == self._last_phase and now - self._last_sent < self._min_interval:
            return
        self._last_sent = now
        self._last_phase = phase
        # The pid per send, not per emitter: a forked child must not pass for its parent.
        data = _WIRE.pack(_WIRE_VERSION, _PHASE_CODE[phase], self._local_rank, os.getpid(), step, now)
        try:
            self._sock.sendto(data, self._addr)
        except OSError as e:
            # A full queue or a vanished agent must never stop training; the agent judges silence, not us.
            if not self._warned:
                self._warned = True
                log.warning("heartbeat to %s dropped (%s); further drops are not logged", self._addr, e)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def die_with_parent(expected_parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent (the agent) dies; exit now if it already has.

    Stock torchrun starts workers in their own session, so a SIGKILLed agent leaves them training,
    unnoticed. PR_SET_PDEATHSIG fires when the parent *thread* that forked us exits; torch's agent
    spawns workers from its main thread, which lives as long as the agent.
    """
    if not sys.platform.startswith("linux"):
        log.warning("workers cannot be tied to their agent on %s (needs Linux prctl)", sys.platform)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s; this worker may outlive its agent", os.strerror(err))
        return
    # The agent may have died before prctl ran: the signal will then never come, so check by hand.
    if os.getppid() == expected_parent_pid:
        return
    if not _pid_alive(expected_parent_pid):
        log.error("agent (pid %d) died before this worker started; exiting", expected_parent_pid)
        os._exit(1)
    log.warning("worker's parent is pid %d, not the agent (pid %d): a wrapper process sits between them; "
                "this worker dies with the wrapper, not directly with the agent", os.getppid(), expected_parent_pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
