"""Replacing confirmed stragglers (`elastic.replace_stragglers`): asked for on rank 0's node, done on the slow rank's.

Rank 0's step loop names a straggler and, when it stays slow for `elastic.straggler_replace_after_steps` more steps,
confirms it (`runtime/stragglers.py`, a `straggler_confirmed` event). Rank 0's agent then writes a replace request to
etcd (`control/replace`, a `ReplaceRequest`); every agent reads it with its control poll (`agent/control.py`), and the
agent whose worker holds that global rank in the same rendezvous round acts, once:

* **restart** (the first time on that host): its workers are asked to re-form (`ControlState.reform_seq`). Every rank
  stops at the next step boundary with the state saved (like a drain) and exits `EXIT_REFORM`; every agent re-forms
  the group on the same nodes, without charging the restart budget, from fresh worker processes (warm spares). This
  cures a slow process: a leak, a stuck thread, a bad CUDA context.
* **drain**, when a rank on the same host was restarted as a straggler less than `elastic.straggler_drain_window_s`
  ago: the slowness is the node's (thermal throttling, a bad NIC). The node drains as on `elastictrain drain`
  (saves, leaves, its agent exits 0) and the others re-form without it, or with a node waiting beyond max_nodes.
* **keep** (report only, a `straggler_kept` event saying why): a drain would leave fewer than min_nodes nodes, or the
  workers save no checkpoint (a restart would lose their progress).

The host's history (`stragglers/hosts/<host>`, a `HostRecord`) is in etcd, so it survives the agent: an agent started
again on a drained host that straggles again is drained at once, without another restart first.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from elastictrain.agent.agent import rdzv_round
from elastictrain.rendezvous.client import EtcdClient

if TYPE_CHECKING:
    from elastictrain.agent.agent import ElasticAgent

log = logging.getLogger(__name__)

ACTIONS = ("restart", "drain")
"""What `straggler_replaced` events and the replacement counter say was done."""


@dataclass(frozen=True)
class ReplacePolicy:
    """The `elastic.*` settings the agents act on."""

    drain_window_s: float = 3600.0
    min_nodes: int = 1


@dataclass
class ReplaceRequest:
    """Rank 0's agent asks the agent of `slow_rank` (in rendezvous round `round`) to replace it."""

    seq: int
    slow_rank: int
    round: int
    step: int
    lateness_s: float
    score: float
    by: str
    time: float

    @classmethod
    def from_json(cls, data: bytes) -> "ReplaceRequest":
        raw = json.loads(data)
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()


@dataclass
class HostRecord:
    """A host's straggler history in this run (unix times)."""

    restarts: list[float] = field(default_factory=list)
    drained: list[float] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: Optional[bytes]) -> "HostRecord":
        if data is None:
            return cls()
        raw = json.loads(data)
        return cls(restarts=list(raw.get("restarts", [])), drained=list(raw.get("drained", [])))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def choose_action(record: HostRecord, now: float, nodes: int, policy: ReplacePolicy) -> tuple[str, str]:
    """("restart" | "drain" | "keep", why) for a confirmed straggler on a host with `record`, in a group of `nodes`."""
    window = policy.drain_window_s
    recent = [t for t in record.restarts + record.drained if now - t < window] if window > 0 else []
    if not recent:
        return "restart", "first time on this host: a fresh worker process may cure it"
    if nodes - 1 < policy.min_nodes:
        return "keep", (f"this host straggled again within elastic.straggler_drain_window_s="
                        f"{window:g}s, but draining it would leave {nodes - 1} node(s), below min_nodes="
                        f"{policy.min_nodes}; add a node or lower min_nodes")
    return "drain", f"this host straggled again within elastic.straggler_drain_window_s={window:g}s: the node is slow"


def replace_key(run_prefix: str) -> str:
    return f"{run_prefix.rstrip('/')}/control/replace"


def host_key(run_prefix: str, host: str) -> str:
    return f"{run_prefix.rstrip('/')}/stragglers/hosts/{host}"


class StragglerReplacer:
    """Both halves on every agent: an event listener that asks (rank 0's node), `poll` that acts (the slow rank's)."""

    def __init__(self, client: EtcdClient, run_prefix: str, policy: ReplacePolicy, host: str,
                 node: Callable[[], Optional[str]], emit: Callable[[str, dict[str, Any]], None],
                 reform: Callable[[], None], drain: Callable[[str], None]):
        self.client, self.prefix, self.policy, self.host = client, run_prefix.rstrip("/"), policy, host
        self._node, self._emit, self._reform, self._drain = node, emit, reform, drain
        self._agent: Optional["ElasticAgent"] = None
        self._seen: Optional[int] = None

    def attach(self, agent: "ElasticAgent") -> None:
        self._agent = agent

    # --- rank 0's node: ask -------------------------------------------------------------------------------

    def on_event(self, kind: str, fields: dict[str, Any]) -> None:
        """An AgentEventListener: a `straggler_confirmed` from this node's rank 0 becomes a replace request."""
        if kind != "straggler_confirmed" or not isinstance(fields.get("slow_rank"), int):
            return
        if not fields.get("saves", False):
            self._emit("straggler_kept", {**_about(fields), "reason": "the workers save no checkpoint: a restart "
                                          "would lose their progress; give Worker.steps a checkpoint"})
            return
        group = self._group()
        if group is None:
            return
        req = ReplaceRequest(seq=time.time_ns(), slow_rank=fields["slow_rank"], round=group[0],
                             step=int(fields.get("step") or 0), lateness_s=float(fields.get("lateness_s") or 0.0),
                             score=float(fields.get("score") or 0.0), by=self._node() or self.host, time=time.time())
        # Called on the agent's monitor thread, which must not wait on etcd.
        threading.Thread(target=self._ask, args=(req,), name="elastictrain-straggler-ask", daemon=True).start()

    def _ask(self, req: ReplaceRequest) -> None:
        try:
            # Above the previous request's, whichever node's clock wrote it (rank 0 moves between nodes).
            got = self.client.get(replace_key(self.prefix))
            if got is not None:
                req.seq = max(req.seq, ReplaceRequest.from_json(got[0]).seq + 1)
            self.client.put(replace_key(self.prefix), req.to_json())
            log.warning("asked for rank %d to be replaced: still a straggler at step %d (%.3fs late per step)",
                        req.slow_rank, req.step, req.lateness_s)
        except Exception as e:  # noqa: BLE001 - etcd down: it stays named; training goes on
            log.warning("could not ask for straggler rank %d to be replaced: %s", req.slow_rank, e)

    # --- the slow rank's node: act ------------------------------------------------------------------------

    def poll(self, raw: dict[str, bytes]) -> None:
        """Act on a new replace request among the control keys just read, when its rank is one of ours."""
        data = raw.get(replace_key(self.prefix))
        req = ReplaceRequest.from_json(data) if data is not None else None
        seq = req.seq if req is not None else 0
        if self._seen is None:
            self._seen = seq  # a request older than this agent was for an earlier group
        if req is None or seq <= self._seen:
            return
        self._seen = seq
        group = self._group()
        if group is None or group[0] != req.round or req.slow_rank not in group[1]:
            return
        self._act(req, group[2])

    def _act(self, req: ReplaceRequest, nodes: int) -> None:
        key = host_key(self.prefix, self.host)
        try:
            got = self.client.get(key)
            record = HostRecord.from_json(got[0] if got is not None else None)
        except Exception as e:  # noqa: BLE001 - etcd unreachable: act on what this agent knows (a restart)
            log.warning("could not read the straggler history of host %s: %s", self.host, e)
            record = HostRecord()
        now = time.time()
        action, why = choose_action(record, now, nodes, self.policy)
        about = {**_about(asdict(req)), "node": self._node() or self.host, "host": self.host,
                 "agent_pid": os.getpid()}
        if action == "keep":
            log.warning("straggler rank %d is not replaced: %s", req.slow_rank, why)
            self._emit("straggler_kept", {**about, "reason": why})
            return
        (record.restarts if action == "restart" else record.drained).append(now)
        try:
            self.client.put(key, record.to_json())
        except Exception as e:  # noqa: BLE001 - the replacement matters more than its record
            log.warning("could not record the straggler history of host %s: %s", self.host, e)
        log.warning("replacing straggler rank %d (%s): %s", req.slow_rank, action, why)
        self._emit("straggler_replaced", {**about, "action": action, "reason": why})
        if action == "restart":
            self._reform()
        else:
            self._drain(f"straggler rank {req.slow_rank}: {why}")

    def _group(self) -> Optional[tuple[int, set[int], int]]:
        """(rendezvous round, this node's global ranks, nodes in the group) of the running group; None before one."""
        if self._agent is None:
            return None
        wg = self._agent.get_worker_group()
        if not wg.workers or wg.workers[0].global_rank is None:
            return None
        try:
            return rdzv_round(wg), {w.global_rank for w in wg.workers}, wg.group_world_size
        except Exception as e:  # noqa: BLE001 - no dynamic rendezvous: nothing to replace with
            log.debug("no rendezvous round to replace stragglers in: %s", e)
            return None


def _about(fields: dict[str, Any]) -> dict[str, Any]:
    """The straggler's fields an event repeats."""
    return {k: fields[k] for k in ("slow_rank", "step", "lateness_s", "score") if k in fields}
