"""One snapshot of a job as operators see it: read from etcd (and checkpoint storage), judged by pure rules.

`derive()` holds every rule (job state, node staleness, health) and takes plain records, so it is tested
without services; `collect()` does the reading. Used by `elastictrain status`, the dashboard and the chaos
runner's local target, so it lives here beside the records it reads (`status.py`), below both.

Node states add: loading (joined, workers not training yet), paused, lost, gone (see `_member`).
Job states: starting, running, pausing, paused, recovering, finished, stopped (every node left, e.g. drained),
failed. Unhealthy (a probe's non-zero exit): failed; recovering for longer than `max_recovering_s`; a node whose
status went stale (`stale_after_s`) while the job has not re-formed without it.
"""

from __future__ import annotations

import io
import logging
import pickle
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from elastictrain.agent.budget import RestartBudget, RestartPolicy
from elastictrain.agent.control import ControlRequest, pause_key
from elastictrain.agent.hang_attribution import HangCulprit, attribute
from elastictrain.agent.ledger import for_job
from elastictrain.agent.status import Event, JobRecord, NodeStatus, read_events, read_job, read_nodes

log = logging.getLogger(__name__)

DEFAULT_STALE_AFTER_S = 10.0
"""A node's status older than this (agents rewrite it every 2 s) means its agent is gone or cut off."""
DEFAULT_MAX_RECOVERING_S = 120.0
"""Recovering for longer than this makes the job unhealthy."""

_TERMINAL = {"succeeded", "left", "failed"}
_TRANSIENT = {"starting", "loading", "rendezvous", "recovering", "draining"}
_LOADING_PHASES = {"-", "init", "load"}


@dataclass
class Member:
    node: str
    host: str
    state: str
    group_rank: Optional[int]
    workers: int
    phases: list[str]
    heartbeat_age_s: Optional[float]
    """Oldest worker heartbeat, as of now."""
    step: Optional[int]
    step_time_s: Optional[float]
    updated_age_s: float
    state_since: float
    last_event: str
    snapshot_step: Optional[int] = None
    """The newest in-memory snapshot in the node's RAM."""
    replicated_step: Optional[int] = None
    """...and the newest its ring peer `replica_peer` confirmed."""
    replica_peer: Optional[str] = None
    stragglers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Ranks named slow now (see NodeStatus.stragglers)."""
    stragglers_replaced: dict[str, int] = field(default_factory=dict)
    last_replacement: Optional[dict[str, Any]] = None
    """See NodeStatus: the stragglers this node's agent replaced."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Per local rank: local_rank, pid, step, phase, heartbeat_age_s (as of now): where a straggler stands out."""


@dataclass
class Rendezvous:
    round: int
    complete: bool
    closed: bool
    participants: int
    waiting: int


@dataclass
class CheckpointView:
    step: int
    age_s: float
    url: str


@dataclass
class JobView:
    run_id: str
    state: str
    healthy: bool
    problems: list[str]
    since: Optional[float]
    step: Optional[int]
    members: list[Member]
    restarts_used: int
    max_restarts: int
    pause_requested: bool
    fatal: Optional[str] = None
    """The worker error that ended the job without a restart (restartable only after a fix)."""
    no_progress_restarts: int = 0
    """Restarts in a row, up to the newest, whose group committed no newer checkpoint."""
    max_no_progress_restarts: int = 0
    backoff_s: float = 0.0
    """The wait before the newest restart (restart backoff)."""
    rendezvous: Optional[Rendezvous] = None
    checkpoint: Optional[CheckpointView] = None
    checkpoint_url: Optional[str] = None
    checkpoint_checked: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)
    ledger: Optional[dict[str, Any]] = None
    """The time ledger (`ledger.py` Ledger.to_dict): buckets, ETTR, the cost of each fault."""
    progress: list[dict[str, Any]] = field(default_factory=list)
    """Training progress over steps from the `progress` events rank 0 reports: step, time, loss, step_time_s,
    tokens_per_s (the dashboard's loss and throughput chart)."""
    last_hang: Optional[HangCulprit] = None
    """The rank the newest hang started at, judged from every node's hang events (read with the events)."""
    in_place: Optional[dict[str, Any]] = None
    """The newest recovery in place (`last_in_place`): when, why, the ranks replaced, whether the paused workers
    resumed and after how long."""
    time: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _member(n: NodeStatus, now: float, stale_after_s: float, superseded_at: float) -> Member:
    age = max(0.0, now - n.updated)
    beats = [w.heartbeat_age_s for w in n.workers if w.heartbeat_age_s is not None]
    phases = [w.phase or "-" for w in n.workers]
    state = n.state
    if state not in _TERMINAL and age > stale_after_s:
        # Superseded: the others re-formed the group after this node went silent; it is history, not a fault.
        state = "gone" if superseded_at > n.updated else "lost"
    elif state == "running" and phases and all(p == "paused" for p in phases):
        state = "paused"
    elif state == "running" and phases and all(p in _LOADING_PHASES for p in phases):
        state = "loading"  # joined, workers not training yet (process group, checkpoint load)
    return Member(node=n.node, host=n.host, state=state, group_rank=n.group_rank, workers=len(n.workers),
                  phases=phases, heartbeat_age_s=round(max(beats) + age, 1) if beats else None, step=n.step,
                  step_time_s=n.step_time_s, updated_age_s=round(age, 1), state_since=n.state_since,
                  last_event=n.last_event, snapshot_step=n.snapshot_step, replicated_step=n.replicated_step,
                  replica_peer=n.replica_peer, stragglers=n.stragglers,
                  stragglers_replaced=n.stragglers_replaced, last_replacement=n.last_replacement,
                  ranks=[{"local_rank": w.local_rank, "pid": w.pid, "step": w.step, "phase": w.phase,
                          "heartbeat_age_s": None if w.heartbeat_age_s is None else round(w.heartbeat_age_s + age, 1)}
                         for w in n.workers])


def derive(run_id: str, nodes: list[NodeStatus], now: float, *, pause_requested: bool = False,
           pause_since: Optional[float] = None, fatal: Optional[str] = None,
           stale_after_s: float = DEFAULT_STALE_AFTER_S,
           max_recovering_s: float = DEFAULT_MAX_RECOVERING_S) -> JobView:
    """Judge a job from its node records (pure: no I/O)."""
    fresh = [n for n in nodes if now - n.updated <= stale_after_s]
    superseded_at = max((n.state_since for n in fresh if n.state == "running"), default=0.0)
    members = [_member(n, now, stale_after_s, superseded_at) for n in nodes]
    live = [m for m in members if m.state not in _TERMINAL | {"gone", "lost"}]
    problems: list[str] = []
    since: Optional[float] = None
    failed = [m for m in members if m.state == "failed"]
    lost = [m for m in members if m.state == "lost"]
    if fatal is not None:
        # Whatever the nodes last said (a node may still be leaving): restarting cannot fix it.
        state = "failed"
        problems.append(f"a worker error that restarting cannot fix ended the job: {fatal}")
        since = max((m.state_since for m in failed), default=None)
    elif failed:
        state = "failed"
        problems += [f"node {m.node} failed ({m.last_event})" for m in failed]
        since = max(m.state_since for m in failed)
    elif not live:
        if any(m.state == "succeeded" for m in members):
            state = "finished"
        elif members and all(m.state == "left" for m in members):
            state = "stopped"
        else:
            state = "failed"
            problems.append("no agent of this job reports any more" if members else "no agent has reported yet")
        since = max((m.state_since for m in members), default=None)
    elif all(m.state in ("starting", "loading") for m in live) and not any(n.restarts_used for n in nodes):
        state, since = "starting", min(m.state_since for m in live)
    elif any(m.state in _TRANSIENT for m in live):
        state = "recovering"
        since = min(m.state_since for m in live if m.state in _TRANSIENT)
        if now - since > max_recovering_s:
            problems.append(f"recovering for {now - since:.0f} s (more than {max_recovering_s:g} s)")
    elif pause_requested:
        state = "paused" if all(m.state == "paused" for m in live) else "pausing"
        since = pause_since or max(m.state_since for m in live)
    elif any(m.state == "paused" for m in live):
        # Paused with no pause requested: waiting in place for a failed rank's replacement (`collect` dates it).
        state = "recovering"
    else:
        state, since = "running", max(m.state_since for m in live)
    problems += [f"node {m.node} ({m.host}) has not reported for {m.updated_age_s:.0f} s" for m in lost]
    restarts_used = max((n.restarts_used for n in nodes), default=0)
    max_restarts = max((n.max_restarts for n in nodes), default=0)
    steps = [m.step for m in live if m.step is not None] or [m.step for m in members if m.step is not None]
    return JobView(run_id=run_id, state=state, healthy=not problems, problems=problems, since=since,
                   step=max(steps) if steps else None, members=members, restarts_used=restarts_used,
                   max_restarts=max_restarts, pause_requested=pause_requested, fatal=fatal, time=now)


PROGRESS_EVENT = "progress"
PROGRESS_POINTS = 500
"""The newest progress reports kept in the view."""


def progress_series(events: list[Event], limit: int = PROGRESS_POINTS) -> list[dict[str, Any]]:
    """Step, time, loss, step time and tokens/s of each `progress` event (fields it lacks are None); tokens/s is
    the step's `tokens` (summed over ranks) over its `step_time_s`."""
    out = []
    for e in events:
        if e.kind != PROGRESS_EVENT or not isinstance(e.fields.get("step"), int):
            continue
        f = e.fields
        num = {k: float(f[k]) if isinstance(f.get(k), (int, float)) else None
               for k in ("loss", "step_time_s", "tokens")}
        rate = num["tokens"] / num["step_time_s"] if num["tokens"] and num["step_time_s"] else None
        out.append({"step": f["step"], "time": e.time, "loss": num["loss"], "step_time_s": num["step_time_s"],
                    "tokens_per_s": None if rate is None else round(rate, 1)})
    return out[-limit:]


def last_in_place(events: list[Event]) -> Optional[dict[str, Any]]:
    """The newest recovery in place: the replacing agent's `restart` event (in_place) and, once the group went on,
    the lowest surviving rank's `in_place_resumed` after it. None when the job never recovered in place."""
    start = next((e for e in reversed(events) if e.kind == "restart" and e.fields.get("in_place")), None)
    if start is None:
        return None
    f = start.fields
    done = next((e for e in events if e.kind == "in_place_resumed" and e.time >= start.time - 1.0
                 and e.fields.get("generation") == f.get("generation")), None)
    out = {"time": start.time, "node": start.node, "reason": f.get("reason") or "failure",
           "generation": f.get("generation"), "replaced_ranks": f.get("replaced_ranks") or [],
           "lost_node": f.get("lost_node"), "resumed": done is not None, "pause_s": None, "step": None,
           "cause": None, "pause_parts": None}
    if done is not None:
        out.update(pause_s=done.fields.get("pause_s"), step=done.fields.get("step"), cause=done.fields.get("cause"),
                   pause_parts=done.fields.get("parts"))
    return out


def event_dict(e: Event) -> dict[str, Any]:
    return {"time": e.time, "node": e.node, "kind": e.kind, "fields": e.fields}


_RDZV_CLASSES = {("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
                 ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
                 ("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta"), ("builtins", "set")}


class _RendezvousUnpickler(pickle.Unpickler):
    """torch keeps the state as a pickle; an operator's CLI loads only the classes that state is made of, so a
    key forged by whoever can write to etcd cannot run code on the operator's machine."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _RDZV_CLASSES:
            raise pickle.UnpicklingError(f"unexpected {module}.{name} in the rendezvous state")
        return super().find_class(module, name)


def read_rendezvous(client: Any, run_prefix: str) -> Optional[Rendezvous]:
    """The rendezvous round from torch's state (a pickle in `<run>/rdzv`), or None when absent or unreadable."""
    got = client.get(f"{run_prefix}/rdzv")
    if got is None:
        return None
    try:
        st = _RendezvousUnpickler(io.BytesIO(got[0])).load()
        return Rendezvous(round=int(st.round), complete=bool(st.complete), closed=bool(st.closed),
                          participants=len(st.participants), waiting=len(st.wait_list))
    except Exception as e:  # another torch version's layout: the round is a nicety
        log.debug("rendezvous state unreadable: %s", e)
        return None


def collect(target: Any, *, events: int = 10, checkpoint: bool = True, ledger: bool = True,
            stale_after_s: float = DEFAULT_STALE_AFTER_S,
            max_recovering_s: float = DEFAULT_MAX_RECOVERING_S) -> JobView:
    """Read everything `status` shows and judge it."""
    # Not at the top: metrics loads prometheus_client, which judging records (the chaos target) does not need.
    from elastictrain.agent.metrics import latest_checkpoint

    client, prefix = target.client, target.prefix
    nodes = read_nodes(client, prefix)
    pause = client.get(pause_key(prefix))
    job: Optional[JobRecord] = read_job(client, prefix)
    policy = RestartPolicy(**job.restart_policy) if job is not None and job.restart_policy else RestartPolicy()
    budget = RestartBudget(client, prefix, policy=policy)
    restarts = budget.state()
    now = time.time()
    view = derive(target.settings.run_id, nodes, now, pause_requested=pause is not None,
                  pause_since=ControlRequest.from_json(pause[0]).time if pause else None,
                  fatal=restarts.fatal.cause if restarts.fatal else None,
                  stale_after_s=stale_after_s, max_recovering_s=max_recovering_s)
    view.restarts_used = max(view.restarts_used, restarts.used)
    view.no_progress_restarts, view.backoff_s = restarts.no_progress, restarts.backoff_s
    view.max_no_progress_restarts = policy.max_no_progress_restarts
    view.rendezvous = read_rendezvous(client, prefix)
    if job is not None:
        view.checkpoint_url = job.checkpoint_url
        view.max_restarts = max(view.max_restarts, job.max_restarts)
        view.checkpoint_checked = checkpoint
        if checkpoint and job.checkpoint_url:
            found = latest_checkpoint(job.checkpoint_url)
            if found is not None:
                view.checkpoint = CheckpointView(step=found[0], age_s=round(time.time() - found[1], 1),
                                                 url=found[2])
    if events or ledger:
        log = read_events(client, prefix)
        view.events = [event_dict(e) for e in log[-events:]] if events else []
        view.last_hang = attribute(log)
        view.in_place = last_in_place(log)
        if view.state == "recovering" and view.since is None and view.in_place and not view.in_place["resumed"]:
            view.since = view.in_place["time"]
            if now - view.since > max_recovering_s:
                view.problems.append(f"paused in place for {now - view.since:.0f} s (more than "
                                     f"{max_recovering_s:g} s)")
                view.healthy = False
        if ledger:
            view.ledger = for_job(log, budget.records(), job, nodes, now).to_dict()
            view.progress = progress_series(log)
    return view
