"""Worker side of agent health: progress heartbeats to the local agent, and dying with the agent.

Channel: one unix datagram socket per agent (path in ``ELASTICTRAIN_HEARTBEAT_ADDR``), shared by all of
its local workers. A datagram is atomic (no torn reads, unlike a shared file), the socket is non-blocking
so a slow or dead agent can never stall a training step (a full queue or a missing socket drops the beat),
and there is nothing per worker to create or clean up. A send costs a few microseconds; beats closer than
``min_interval_s`` are skipped unless the phase changes, so calling ``beat`` every step costs well under a
microsecond in the common case. Only a beat that was sent counts: after a dropped one (the agent's queue holds
few datagrams, ``net.unix.max_dgram_qlen``) the next beat is sent whatever its phase and timing, so a dropped
phase change ("save", "done") reaches the agent with the next beat instead of never. The agent needs progress,
not every step: it derives step time from (time, step) deltas between the beats it does receive.

The socket path lives in a 0700 directory made by the agent, so other users cannot spoof beats.

The same channel carries worker events for the job's event log (``Heartbeat.event``: checkpoint saved, failed,
skipped...): workers have no etcd client, and their agent already publishes its own events there. An event is a
second kind of datagram: a small versioned header, then the event as JSON, at most ``MAX_EVENT_BYTES``. It is
sent like a beat, never blocking; one that cannot be sent is dropped and logged (the first drop only).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

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
SECTION_PREFIX = "section:"
"""A user section's phase is ``section:<n>`` (`Worker.section`: n numbers the worker's section names in order)."""
_SECTION_BASE = 32
MAX_SECTIONS = 200
"""Distinct section names one worker may use (their numbers fit the wire's phase byte)."""


def section_phase(number: int) -> str:
    return f"{SECTION_PREFIX}{number}"


def _phase_code(phase: str) -> int:
    """The wire code of a phase; ValueError for anything else."""
    if phase in _PHASE_CODE:
        return _PHASE_CODE[phase]
    if phase.startswith(SECTION_PREFIX) and phase[len(SECTION_PREFIX):].isdigit():
        number = int(phase[len(SECTION_PREFIX):])
        if number < MAX_SECTIONS:
            return _SECTION_BASE + number
    raise ValueError(f"heartbeat phase {phase!r} is not one of {', '.join(PHASES)} or section:<0..{MAX_SECTIONS - 1}>")


def _phase_of(code: int) -> str:
    if code < len(PHASES):
        return PHASES[code]
    if _SECTION_BASE <= code < _SECTION_BASE + MAX_SECTIONS:
        return section_phase(code - _SECTION_BASE)
    raise ValueError(f"heartbeat phase code {code} is unknown")

_WIRE_VERSION = 1
# version, phase, local_rank, pid, step, worker monotonic time
_WIRE = struct.Struct("<BBHiqd")

MAX_EVENT_BYTES = 8192
"""Largest JSON payload of a worker event; longer text fields are cut to fit (a failure's cause can be long)."""

WORKER_EVENT_PREFIXES: tuple[str, ...] = ("checkpoint_", "straggler", "section_", "in_place_", "progress")
"""Kinds a worker may report. The agent's own kinds (join, failure, ...) change a node's state; these never do."""

_EVENT_MAGIC = ord("E")  # first byte of an event datagram; beats start with their wire version (1)
_EVENT_VERSION = 1
# magic, version, local_rank, pid, global rank (-1: unknown); then the JSON payload
_EVENT_HEAD = struct.Struct("<BBHii")
MAX_DATAGRAM_BYTES = _EVENT_HEAD.size + MAX_EVENT_BYTES
"""The agent's receive size: any datagram a worker sends fits."""
_CUT_TEXT = 512

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
        return _WIRE.pack(_WIRE_VERSION, _phase_code(self.phase), self.local_rank, self.pid, self.step, self.time)

    @classmethod
    def unpack(cls, data: bytes) -> Beat:
        """Decode a datagram; raises ValueError on anything that is not a beat of this wire version."""
        if len(data) != _WIRE.size:
            raise ValueError(f"heartbeat datagram has {len(data)} bytes, expected {_WIRE.size}")
        version, phase, local_rank, pid, step, t = _WIRE.unpack(data)
        if version != _WIRE_VERSION:
            raise ValueError(f"heartbeat datagram of unknown version {version}")
        return cls(local_rank=local_rank, pid=pid, step=step, phase=_phase_of(phase), time=t)


@dataclass(frozen=True)
class WorkerEvent:
    """One event a worker reports for the job's event log, as it crosses the process boundary."""

    local_rank: int
    rank: int | None
    """The worker's global rank (None when unknown)."""
    pid: int
    kind: str
    fields: dict[str, Any] = field(default_factory=dict)

    def pack(self) -> bytes:
        """Header + JSON; text fields are cut so that it fits; ValueError if it still does not."""
        payload = _event_json(self.kind, self.fields)
        if len(payload) > MAX_EVENT_BYTES:
            cut = {k: v[:_CUT_TEXT] + "..." if isinstance(v, str) and len(v) > _CUT_TEXT else v
                   for k, v in self.fields.items()}
            payload = _event_json(self.kind, cut)
        if len(payload) > MAX_EVENT_BYTES:
            raise ValueError(f"worker event {self.kind} is {len(payload)} bytes of JSON, more than {MAX_EVENT_BYTES}")
        rank = -1 if self.rank is None else self.rank
        return _EVENT_HEAD.pack(_EVENT_MAGIC, _EVENT_VERSION, self.local_rank, self.pid, rank) + payload

    @classmethod
    def unpack(cls, data: bytes) -> WorkerEvent:
        """Decode a datagram; raises ValueError on anything that is not a worker event of this version."""
        if len(data) < _EVENT_HEAD.size:
            raise ValueError(f"event datagram has {len(data)} bytes, shorter than its header")
        magic, version, local_rank, pid, rank = _EVENT_HEAD.unpack_from(data)
        if magic != _EVENT_MAGIC or version != _EVENT_VERSION:
            raise ValueError(f"not a worker event of version {_EVENT_VERSION} (first bytes {magic}, {version})")
        try:
            body = json.loads(data[_EVENT_HEAD.size:])
            kind, fields = body["kind"], body["fields"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"worker event payload unreadable: {e}") from None
        if not isinstance(fields, dict) or not is_worker_event_kind(kind):
            raise ValueError(f"worker event of kind {kind!r} is not one a worker may report")
        return cls(local_rank=local_rank, rank=None if rank < 0 else rank, pid=pid, kind=kind, fields=fields)


def _event_json(kind: str, fields: dict[str, Any]) -> bytes:
    return json.dumps({"kind": kind, "fields": fields}, default=str, separators=(",", ":")).encode()


def is_worker_event_kind(kind: Any) -> bool:
    """Whether a worker may report events of this kind (see ``WORKER_EVENT_PREFIXES``)."""
    return isinstance(kind, str) and kind.startswith(WORKER_EVENT_PREFIXES)


def decode(data: bytes) -> Beat | WorkerEvent:
    """A datagram from the heartbeat socket, beat or event; ValueError on anything else."""
    if data[:1] == bytes([_EVENT_MAGIC]):
        return WorkerEvent.unpack(data)
    return Beat.unpack(data)


class Heartbeat:
    """Emits (step, phase) progress and worker events to the agent; a no-op when not started by our agent."""

    def __init__(self, addr: str | None, local_rank: int = 0, min_interval_s: float = DEFAULT_MIN_INTERVAL_S,
                 rank: int | None = None):
        self._addr = addr
        self._local_rank = local_rank
        self._rank = rank
        self._min_interval = min_interval_s
        self._last_sent = float("-inf")
        self._last_phase = ""
        self._sock: socket.socket | None = None
        self._warned = False
        self._event_warned = False
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
        rank = os.environ.get("RANK")
        hb = cls(addr, local_rank=int(os.environ.get("LOCAL_RANK", 0)), min_interval_s=interval,
                 rank=int(rank) if rank else None)
        hb.beat(0, "init")
        return hb

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    @property
    def phase(self) -> str:
        """The phase of the last beat sent ("train" before any)."""
        return self._last_phase or "train"

    def beat(self, step: int, phase: str = "train") -> None:
        """Report progress: ``step`` is the global step, ``phase`` one of init/load/train/save/paused/done or a
        user section's ``section:<n>``."""
        if self._sock is None:
            return
        code = _phase_code(phase)
        now = time.monotonic()
        if phase == self._last_phase and now - self._last_sent < self._min_interval:
            return
        # The pid per send, not per emitter: a forked child must not pass for its parent.
        data = _WIRE.pack(_WIRE_VERSION, code, self._local_rank, os.getpid(), step, now)
        try:
            self._sock.sendto(data, self._addr)
        except OSError as e:
            # A full queue or a vanished agent must never stop training; the agent judges silence, not us.
            # Not recorded as sent: the next beat goes out unthrottled, so a dropped phase change is sent again.
            if not self._warned:
                self._warned = True
                log.warning("heartbeat to %s dropped (%s); further drops are not logged", self._addr, e)
            return
        self._last_sent = now
        self._last_phase = phase

    def event(self, kind: str, **fields: Any) -> None:
        """Report an event for the job's event log (through the agent); ``kind`` starts with ``checkpoint_``.

        Never blocks and never raises on a failed send: the event is then lost, and the first loss is logged.
        """
        if not is_worker_event_kind(kind):
            raise ValueError(f"worker event kind {kind!r} must start with one of {', '.join(WORKER_EVENT_PREFIXES)}")
        if self._sock is None:
            return
        try:
            data = WorkerEvent(self._local_rank, self._rank, os.getpid(), kind, fields).pack()
            self._sock.sendto(data, self._addr)
        except (OSError, ValueError) as e:
            if not self._event_warned:
                self._event_warned = True
                log.warning("worker event %s to %s dropped (%s); further drops are not logged", kind, self._addr, e)

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
    if not pid_alive(expected_parent_pid):
        log.error("agent (pid %d) died before this worker started; exiting", expected_parent_pid)
        os._exit(1)
    log.warning("worker's parent is pid %d, not the agent (pid %d): a wrapper process sits between them; "
                "this worker dies with the wrapper, not directly with the agent", os.getppid(), expected_parent_pid)


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists (ours or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
