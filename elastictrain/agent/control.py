"""Operator control keys in etcd and the agent's relay of them to its workers.

Keys, under the run's prefix (`/elastictrain/<run_id>`), written by `elastictrain drain|pause|resume|ckpt now`:

    control/pause           present while the job should be paused (ControlRequest JSON); `resume` deletes it.
    control/ckpt            ControlRequest whose `seq` grows with every `ckpt now`.
    control/drain/<node>    drain that node; its agent deletes the key when it acts.
    control/replace         the newest straggler replace request (`agent/straggler_replace.py`).

Every agent polls `control/` (one range read every `interval_s`) and relays: a drain makes the agent signal
itself SIGTERM (the same path as an operator's `kill -TERM`: workers finish the step, save, the peers re-form
without this node); pause/resume, checkpoint and re-form requests go to the workers through the control file and a
doorbell signal (see `elastictrain.runtime.control`). Relaying never fails training: etcd errors are logged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Optional

from elastictrain.agent.scratch import make_scratch_dir
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.runtime.control import DOORBELL, ENV_CONTROL_FILE, ControlState

if TYPE_CHECKING:
    from elastictrain.agent.agent import ElasticAgent

log = logging.getLogger(__name__)

DEFAULT_CONTROL_INTERVAL_S = 1.0
"""How often each agent reads the control keys."""


@dataclass
class ControlRequest:
    """One operator request as stored in a control key."""

    action: str
    by: str
    time: float
    seq: int = 0
    reason: str = ""

    @classmethod
    def from_json(cls, data: bytes) -> "ControlRequest":
        raw = json.loads(data)
        return cls(**{k: raw[k] for k in ("action", "by", "time", "seq", "reason") if k in raw})

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def control_prefix(run_prefix: str) -> str:
    return f"{run_prefix.rstrip('/')}/control/"


def pause_key(run_prefix: str) -> str:
    return control_prefix(run_prefix) + "pause"


def ckpt_key(run_prefix: str) -> str:
    return control_prefix(run_prefix) + "ckpt"


def drain_key(run_prefix: str, node: str) -> str:
    return control_prefix(run_prefix) + f"drain/{node}"


class ControlRelay:
    """Polls the control keys and relays them to this agent's workers (and to itself, for a drain)."""

    def __init__(self, client: EtcdClient, run_prefix: str, node: Callable[[], Optional[str]],
                 emit: Callable[[str, dict[str, Any]], None], interval_s: float = DEFAULT_CONTROL_INTERVAL_S):
        self.client, self.prefix = client, run_prefix.rstrip("/")
        self._node, self._emit, self.interval_s = node, emit, interval_s
        self._dir = make_scratch_dir("ctl")
        self.path = os.path.join(self._dir, "control.json")
        self.state = ControlState()
        self.state.write(self.path)
        self._agent: Optional["ElasticAgent"] = None
        self._ckpt_seen: Optional[int] = None
        self._rung: dict[int, ControlState] = {}
        self._draining = False
        self.pollers: list[Callable[[dict[str, bytes]], None]] = []
        """Also given the control keys at each poll (the straggler replacer's requests)."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def env(self) -> dict[str, str]:
        """Environment for the workers (the agent passes its own environment on)."""
        return {ENV_CONTROL_FILE: self.path}

    def attach(self, agent: "ElasticAgent") -> None:
        self._agent = agent
        self._thread = threading.Thread(target=self._loop, name="elastictrain-control", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as e:  # etcd down: try again next time; training goes on
                log.debug("control poll failed: %s", e)

    def poll(self) -> None:
        """Read the control keys once and relay what changed."""
        with self.client.tolerance(self.client.settings.request_timeout):
            raw = self.client.get_prefix(control_prefix(self.prefix))
        node = self._node()
        if node and not self._draining and drain_key(self.prefix, node) in raw:
            self._drain(node, ControlRequest.from_json(raw[drain_key(self.prefix, node)]))
        for poller in self.pollers:
            poller(raw)
        paused = pause_key(self.prefix) in raw
        ckpt = raw.get(ckpt_key(self.prefix))
        seq = ControlRequest.from_json(ckpt).seq if ckpt is not None else 0
        if self._ckpt_seen is None:
            self._ckpt_seen = seq  # requests older than this agent were for an earlier group
        wanted = ControlState(paused=paused, ckpt_seq=self.state.ckpt_seq, reform_seq=self.state.reform_seq)
        if seq > self._ckpt_seen:
            self._ckpt_seen = seq
            wanted.ckpt_seq = seq
            self._emit("control", {"action": "ckpt", "seq": seq})
        if paused != self.state.paused:
            self._emit("control", {"action": "pause" if paused else "resume"})
        if wanted != self.state:
            self.state = wanted
            wanted.write(self.path)
        self._ring()

    def _ring(self) -> None:
        """Ring every worker that has not seen the current state and can take the signal (it has beaten)."""
        if self._agent is None:
            return
        beaten = {w.pid for w in self._agent.worker_health().values() if w.last_beat is not None}
        self._rung = {pid: s for pid, s in self._rung.items() if pid in beaten}
        for pid in beaten:
            if self._rung.get(pid) == self.state:
                continue
            try:
                os.kill(pid, DOORBELL)
                self._rung[pid] = self.state
            except ProcessLookupError:
                continue

    def request_reform(self) -> None:
        """Ask this node's workers to stop at the next step boundary, saved, for the group to re-form (every rank
        stops with them: the step's all_reduce agrees on it)."""
        self.state = replace(self.state, reform_seq=self.state.reform_seq + 1)
        self.state.write(self.path)
        self._ring()

    def drain_self(self, reason: str) -> None:
        """Drain this node as an operator's `elastictrain drain` would (the straggler replacer's last resort)."""
        node = self._node()
        if node and not self._draining:
            self._drain(node, ControlRequest(action="drain", by="straggler replacement", time=time.time(),
                                             reason=reason), delete=False)

    def _drain(self, node: str, req: ControlRequest, delete: bool = True) -> None:
        self._draining = True
        try:
            if delete:
                self.client.delete(drain_key(self.prefix, node))
        except Exception as e:
            log.warning("could not delete the drain request for %s: %s", node, e)
        self._emit("control", {"action": "drain", "by": req.by, "reason": req.reason})
        log.warning("drain of node %s requested by %s: stopping like on SIGTERM", node, req.by)
        # The agent's main thread turns SIGTERM into torch's SignalException: workers finish their step, save,
        # and `elastictrain run` leaves the rendezvous so that the peers re-form at once.
        os.kill(os.getpid(), signal.SIGTERM)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)
