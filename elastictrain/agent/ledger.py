"""The time ledger of a job: where its wall time went, what each fault cost, and its ETTR.

A pure function (`compute`) over what the agents already record in etcd for the run: the event log
(`status.py`), the restart records (`budget.py`) and the step the nodes report now. Every reader (`elastictrain
status`, `events`, the dashboard, the metrics endpoint, the `fault_cost` event) calls it on the same inputs, so
they all show the same numbers, and it is tested on plain event lists.

The job's wall time (from its first record to its end, or now) is cut into buckets that add up to it:

    starting     job start -> the first group trains (rendezvous, worker start, first load)
    training     useful training: steps run for the first time, less the three below
    checkpoint   training blocked on checkpoint saves (`checkpoint_saved` blocking_s)
    paused       paused by an operator (`elastictrain pause` until `resume`, as the agents relayed it)
    detecting    a fault happened -> an agent noticed (hang: the silence; failure: `last_beat_age_s` when known)
    restarting   noticed -> the new group formed (stop, backoff, rendezvous, re-join, in-place rebuild)
    loading      the group formed -> its state loaded (checkpoint or snapshot)
    recomputing  steps run again because the state loaded is older than the step reached before the fault

ETTR = training / wall. Recomputed steps: the step reached before a fault (restart record, hang report,
in-place report, newest save) minus the step the next group loaded; their seconds at the next group's own pace.

What the log cannot say is estimated, and documented here: a worker crash is noticed within the agent's monitor
interval, so without `last_beat_age_s` its detection counts 0 s (the time is in `training`); a group that loaded
nothing starts training when its last node joined.

A full restart (the job started again on an etcd that holds none of its history, e.g. `elastictrain run`'s
embedded one) continues the ledger kept beside its checkpoints (`ledger_file.py`): the agent at group rank 0
appends its totals as one `ledger_carried` event, and `compute` adds them (buckets, faults, wall time) to what this
etcd saw. The time between the carried ledger's last write and this start, with this start-up (re-forming,
loading) and the steps run again, is one fault of kind "full restart"; after a job that had ended (succeeded or
gave up), the time between is `paused` and the start-up `starting`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Optional

log = logging.getLogger(__name__)

BUCKETS = ("training", "checkpoint", "paused", "detecting", "restarting", "loading", "recomputing", "starting")
LOST_BUCKETS = ("detecting", "restarting", "loading", "recomputing")
"""What a fault costs (the other non-training buckets are the job's own choice: saves, pauses, start-up)."""

FAULT_COST_EVENT = "fault_cost"
CARRIED_EVENT = "ledger_carried"
"""The totals of the job's earlier life, from before this etcd knew it (fields: `carry_record`'s dict)."""
_INTERRUPTS = {"failure", "hang", "restart", "reform"}
_LOADS = {"checkpoint_loaded", "checkpoint_snapshot_loaded"}
_ENDS = {"succeeded", "fatal", "budget_exhausted", "crash_loop", "no_progress"}
_BOOKKEEPING = {"checkpoint_snapshot_replicated", "checkpoint_snapshot_replica_failed", "checkpoint_snapshot_interval",
                "checkpoint_snapshot_skipped", "checkpoint_snapshot_failed", "checkpoint_snapshot_resumed",
                "checkpoint_deleted", "checkpoint_skipped", "checkpoint_failed", "checkpoint_storage_unreachable",
                "checkpoint_storage_full", "section_declared"}
"""Events that come at any time, also while a group recovers (an agent's replica to a peer that just joined, a save
that failed with the aborted group, a corrupt checkpoint skipped by the load): no sign that training resumed."""
_NOT_TRAINING = _INTERRUPTS | _LOADS | _ENDS | _BOOKKEEPING | {"join", "leave", "drain", "operator", FAULT_COST_EVENT,
                                                               CARRIED_EVENT, "in_place_resumed", "shrink", "grow"}


def _interrupts(e: "_Ev") -> bool:
    """An event that opens an interruption: a failure, hang, restart or re-form, or the one agent's record of a node
    that left the round in place (a smaller world: `shrink` with `recorded_here`; the other agents' follow it)."""
    return e.kind in _INTERRUPTS or (e.kind == "shrink" and bool(e.fields.get("recorded_here")))


@dataclass
class FaultCost:
    """One interruption of training and what it cost, in seconds of the job's wall time."""

    at: float
    """Unix time an agent noticed it (its first event)."""
    cause: str
    kind: str
    """failure, hang, restart (membership change), reform (drain)."""
    node: str
    detection_s: float
    restart_s: float
    load_s: float
    recomputed_steps: int
    recompute_s: float
    lost_s: float
    step_reached: Optional[int]
    """The highest step the group reached before it."""
    resumed_step: Optional[int]
    """The step the next group loaded (None: it is still re-forming)."""
    resumed_at: Optional[float]
    """Unix time the next group was training again (None: not yet)."""
    complete: bool
    """The next group is past `step_reached` (or the job ended): the numbers are final."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Ledger:
    started: float
    until: float
    wall_s: float
    buckets: dict[str, float]
    faults: list[FaultCost] = field(default_factory=list)
    ended: bool = False
    carried: Optional[dict[str, Any]] = None
    """The earlier life this ledger continues (a full restart): its started, until, wall_s, faults (how many of
    `faults` come first from it), url; None when this etcd saw the whole job."""
    step: Optional[int] = None
    """The highest step the job reached (what a full restart after now would have to get back to)."""

    @property
    def carried_faults(self) -> int:
        return int(self.carried["faults"]) if self.carried else 0

    @property
    def ettr(self) -> Optional[float]:
        return round(self.buckets["training"] / self.wall_s, 4) if self.wall_s > 0 else None

    @property
    def recomputed_steps(self) -> int:
        return sum(f.recomputed_steps for f in self.faults)

    def lost_by_cause(self) -> dict[str, float]:
        """Seconds lost to faults, by kind (the dashboard's bar), plus the other non-training buckets."""
        out: dict[str, float] = {}
        for f in self.faults:
            out[f.kind] = round(out.get(f.kind, 0.0) + f.lost_s, 3)
        for b in ("checkpoint", "paused", "starting"):
            if self.buckets[b] > 0:
                out[b] = self.buckets[b]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"started": self.started, "until": self.until, "wall_s": round(self.wall_s, 3),
                "buckets": self.buckets, "ettr": self.ettr, "recomputed_steps": self.recomputed_steps,
                "lost_by_cause": self.lost_by_cause(), "ended": self.ended, "carried": self.carried, "step": self.step,
                "faults": [f.to_dict() for f in self.faults]}


@dataclass
class _Ev:
    time: float
    node: str
    kind: str
    fields: dict[str, Any]


@dataclass
class _Gap:
    """An interruption being read: from its first event to the group training again."""

    at: float
    kind: str
    cause: str
    node: str
    detection_s: float = 0.0
    step_reached: Optional[int] = None
    last_join: Optional[float] = None
    load_at: Optional[float] = None
    loaded_step: Optional[int] = None
    in_place_at: Optional[float] = None
    resumed_at: Optional[float] = None
    members: frozenset[str] = frozenset()
    """The nodes of the group it interrupted."""
    seen: set[str] = field(default_factory=set)
    """Nodes that reported anything during it."""
    joined: set[str] = field(default_factory=set)
    back_dated: bool = False
    """Opened by a late record (a smaller world's `shrink`): the pause reported on resuming says when it began."""


def _ev(e: Any) -> _Ev:
    if isinstance(e, dict):
        return _Ev(float(e["time"]), str(e.get("node", "")), str(e["kind"]), dict(e.get("fields") or {}))
    return _Ev(float(e.time), e.node, e.kind, dict(e.fields))


def _int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _detection(e: _Ev) -> float:
    if e.kind == "hang":
        silent = [w.get("silent_s") for w in e.fields.get("workers") or [] if isinstance(w, dict)]
        return max((float(s) for s in silent if isinstance(s, (int, float))), default=0.0)
    if e.kind == "failure":
        ages = [f.get("last_beat_age_s") for f in e.fields.get("failures") or [] if isinstance(f, dict)]
        return min((float(a) for a in ages if isinstance(a, (int, float))), default=0.0)
    return 0.0


def _reached(e: _Ev) -> Optional[int]:
    """The step an interrupting event says the group reached."""
    if e.kind == "hang":
        steps = [_int(w.get("step")) for w in e.fields.get("workers") or [] if isinstance(w, dict)]
        return max((s for s in steps if s is not None), default=None)
    if e.kind in ("failure", "restart"):  # each node's agent: its workers' last beats
        return _int(e.fields.get("step_reached"))
    return _int(e.fields.get("failed_step")) if e.kind == "in_place_resumed" else None


def _cause(e: _Ev) -> str:
    if e.kind == "restart":
        return f"restart ({e.fields.get('reason', 'membership change')})"
    return str(e.fields.get("cause") or e.kind)


_KINDS = {"failure": "worker failure", "hang": "hang", "restart": "membership change", "reform": "re-form"}


def _open(e: _Ev, members: frozenset[str]) -> _Gap:
    held = e.fields.get("held_since")
    if e.kind == "restart" and isinstance(held, (int, float)) and held < e.time:
        # A node that took a lost node's place in place: the survivors paused when the node was lost (its place
        # held since its lease expired), not when the new node started.
        return _Gap(at=float(held), kind="node lost", cause=f"node {e.fields.get('lost_node', '?')} lost; its place "
                    f"taken in place by {e.node}", node=e.node, step_reached=_reached(e), members=members,
                    seen={e.node})
    if e.kind == "shrink":
        # Recorded once the lost node's lease expired (a drain: as its agent was stopped); `in_place_resumed`'s
        # pause dates the gap back to when the survivors stopped training.
        drained = e.fields.get("reason") == "node drained"
        lost = ", ".join(map(str, e.fields.get("lost_nodes") or [])) or "?"
        return _Gap(at=e.time, kind="node drained" if drained else "node lost",
                    cause=f"node {lost} {'drained' if drained else 'lost'}; the others went on without it in place "
                          f"(world size {e.fields.get('world_size', '?')})", node=e.node, members=members,
                    seen={e.node}, back_dated=True)
    return _Gap(at=e.time, kind=_KINDS.get(e.kind, e.kind), cause=_cause(e), node=e.node,
                detection_s=_detection(e), step_reached=_reached(e), members=members, seen={e.node})


def _grown(e: _Ev) -> _Gap:
    """A node joined in place (a grow, rendezvous/shrink.py): the group trained until its new workers were ready, then
    paused `pause_s` to re-form; the resume is the only record of it."""
    pause = e.fields.get("pause_s")
    pause = float(pause) if isinstance(pause, (int, float)) and not isinstance(pause, bool) else 0.0
    g = _Gap(at=e.time - pause, kind="node joined", cause=f"a node joined in place (world size "
             f"{e.fields.get('from_world_size', '?')} -> {e.fields.get('to_world_size', '?')})", node=e.node,
             step_reached=_reached(e), seen={e.node})  # no members: nobody was lost
    g.in_place_at, g.loaded_step = e.time, _int(e.fields.get("step"))
    _close(g)
    return g


def _close(g: _Gap) -> None:
    if g.in_place_at is not None and (g.load_at is None or g.in_place_at >= g.load_at):
        g.resumed_at = g.in_place_at
    else:
        g.resumed_at = g.load_at if g.load_at is not None else g.last_join


def _max(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return b if a is None else a if b is None else max(a, b)


def _read_gaps(events: list[_Ev], started: float) -> tuple[_Gap, list[_Gap], Optional[float]]:
    """The start-up (a gap of kind "start"), the interruptions in order, and the end time (None: running)."""
    start = _Gap(at=started, kind="start", cause="job start", node="")
    gaps: list[_Gap] = []
    cur: Optional[_Gap] = start
    members: frozenset[str] = frozenset()
    prev: Optional[_Ev] = None
    for e in events:
        if prev is not None:  # after the event that changed it opened its gap (a lost member is judged there)
            members = _membership(prev, members)
        prev = e
        if cur is not None and cur.resumed_at is None:
            cur.seen.add(e.node)
        if e.kind == "join" and cur is not None and cur.in_place_at is None:
            cur.joined.add(e.node)
            members = frozenset(cur.joined)
        elif e.kind == "join":  # a node growing the world back in place: one more member of the running group
            members = members | {e.node}
        if e.kind in _ENDS:
            if cur is not None and cur.resumed_at is None:
                _close(cur)
            return start, gaps, e.time
        if cur is not None and cur.in_place_at is not None and (
                e.kind == "join" or (e.kind == "in_place_resumed" and e.fields.get("grew"))):
            # Resumed in place already; a node that joins now grows the world back (its own short pause, if any).
            _close(cur)
            cur = None
        if cur is not None:
            if e.kind == "join":
                cur.last_join, cur.load_at, cur.in_place_at = e.time, None, None
                continue
            if e.kind in _LOADS:
                if cur.last_join is not None and (cur.load_at is None or e.time >= cur.load_at):
                    cur.load_at = e.time
                    cur.loaded_step = _max(cur.loaded_step, _int(e.fields.get("step")))
                continue
            if e.kind == "in_place_resumed":
                cur.in_place_at, cur.loaded_step = e.time, _int(e.fields.get("step"))
                pause = e.fields.get("pause_s")
                if cur.back_dated and isinstance(pause, (int, float)) and not isinstance(pause, bool):
                    cur.at = min(cur.at, e.time - float(pause))
                cur.step_reached = _max(cur.step_reached, _reached(e))
                continue
            if _interrupts(e):
                if cur.last_join is None and cur.in_place_at is None:
                    # the same interruption, seen by another node (or its restart after its failure)
                    cur.step_reached = _max(cur.step_reached, _reached(e))
                    cur.detection_s = max(cur.detection_s, _detection(e))
                    continue
                _close(cur)
                cur = _open(e, members)
                gaps.append(cur)
                continue
            if e.kind not in _NOT_TRAINING and (cur.last_join is not None or cur.in_place_at is not None):
                _close(cur)  # the group is doing training's business again (a save, a pause, a straggler)
                cur = None
            continue
        if _interrupts(e):
            cur = _open(e, members)
            gaps.append(cur)
        elif e.kind == "in_place_resumed" and e.fields.get("grew"):
            gaps.append(_grown(e))
    if cur is not None and cur.resumed_at is None and (cur.last_join is not None or cur.in_place_at is not None):
        _close(cur)
    return start, gaps, None


def _membership(e: _Ev, members: frozenset[str]) -> frozenset[str]:
    """The running group's nodes after in-place event `e`: a shrink drops its lost nodes, a grow swaps the places it
    took for the nodes that took them, a held place taken over swaps the lost node for the new one."""
    f = e.fields
    if e.kind == "shrink":
        return members - frozenset(map(str, f.get("lost_nodes") or ()))
    if e.kind == "grow":
        return (members - frozenset(map(str, f.get("places_of") or ()))) | frozenset(map(str, f.get("joined_nodes")
                                                                                          or ()))
    if e.kind == "restart" and f.get("lost_node"):
        return (members - {str(f["lost_node"])}) | {e.node}
    return members


def _judge_lost(g: _Gap, updated: dict[str, float]) -> None:
    """A node of the interrupted group that said nothing since (no failure, no restart, no join) was lost: its
    agent died with it. Its status, rewritten every 2 s until then, dates the loss (an upper bound)."""
    lost = sorted(g.members - g.seen)
    if not lost:
        return
    g.kind = "node lost"
    g.cause = f"node {', '.join(lost)} lost (peer saw: {g.cause})"
    last = [updated[n] for n in lost if n in updated and updated[n] <= g.at]
    if last:
        g.detection_s = max(g.detection_s, g.at - max(last))


def _pauses(events: list[_Ev]) -> list[tuple[float, float]]:
    """Operator pauses as the agents relayed them: first node's pause -> last node's resume."""
    out: list[tuple[float, float]] = []
    since: Optional[float] = None
    paused: set[str] = set()
    for e in events:
        if e.kind != "control" or e.fields.get("action") not in ("pause", "resume"):
            continue
        if e.fields["action"] == "pause":
            if since is None:
                since = e.time
            paused.add(e.node)
        elif since is not None:
            paused.discard(e.node)
            if not paused:
                out.append((since, e.time))
                since = None
    if since is not None:
        out.append((since, float("inf")))
    return out


def _overlap(a: float, b: float, spans: Iterable[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans)


def _saves(events: list[_Ev]) -> list[tuple[float, float]]:
    """(time, seconds training was blocked) per checkpoint step: ranks block together, so the slowest rank's."""
    per_step: dict[Any, tuple[float, float]] = {}
    for e in events:
        b = e.fields.get("blocking_s")
        if e.kind == "checkpoint_saved" and isinstance(b, (int, float)):
            key = (e.fields.get("step"), e.fields.get("url"))
            t, s = per_step.get(key, (e.time, 0.0))
            per_step[key] = (min(t, e.time), max(s, float(b)))
    return list(per_step.values())


def _restart_steps(restarts: Iterable[Any]) -> list[tuple[float, int]]:
    out = []
    for r in restarts:
        raw = r if isinstance(r, dict) else asdict(r)
        step = _int(raw.get("step"))
        if step is not None and isinstance(raw.get("time"), (int, float)):
            out.append((float(raw["time"]), step))
    return out


def compute(events: Iterable[Any], *, restarts: Iterable[Any] = (), started: Optional[float] = None,
            now: float, current_step: Optional[int] = None, final_step: Optional[int] = None,
            node_updated: Optional[dict[str, float]] = None) -> Ledger:
    """The job's ledger from its event log (status.Event or dicts), restart records (budget.RestartRecord or
    dicts), its start (JobRecord.started; default: the first event) and the step its nodes report now.

    `final_step`: the step count a job that succeeded ended at (its `train.steps`); `node_updated`: node -> the
    last time its status was written (`NodeStatus.updated`), which dates a lost node's end."""
    evs = sorted((_ev(e) for e in events), key=lambda e: e.time)
    carries = [e for e in evs if e.kind == CARRIED_EVENT]
    evs = [e for e in evs if e.kind not in (FAULT_COST_EVENT, CARRIED_EVENT)]
    first = evs[0].time if evs else now
    t0 = min(started, first) if started is not None else first
    carried = _carried(carries, t0)
    relaunch = carried is not None and not carried["ended"]
    start, gaps, end = _read_gaps(evs, t0)
    if relaunch and carried is not None:
        start.kind, start.cause = "full restart", "job started again with no history in etcd (ledger carried)"
        start.step_reached = carried["step"]
    for g in gaps:
        _judge_lost(g, node_updated or {})
    until = end if end is not None else now
    saves, pauses = _saves(evs), _pauses(evs)
    restart_steps = _restart_steps(restarts)
    buckets = dict.fromkeys(BUCKETS, 0.0)

    def fault_time(g: _Gap, lo: float) -> float:
        return max(lo, g.at - g.detection_s)

    # training segments: [resume of one gap, fault time of the next)
    chain = [start, *gaps]
    seg_start = start.resumed_at if start.resumed_at is not None else until
    buckets["starting"] = 0.0 if relaunch else min(seg_start, until) - t0
    faults: list[FaultCost] = []
    last_reached: Optional[int] = None
    for i, g in enumerate(chain):
        nxt = chain[i + 1] if i + 1 < len(chain) else None
        lo = g.resumed_at if g.resumed_at is not None else until
        hi = fault_time(nxt, lo) if nxt is not None else until
        hi = min(max(hi, lo), until)
        seg = hi - lo
        blocked = sum(s for t, s in saves if lo <= t <= hi + 1.0)
        paused = _overlap(lo, hi, pauses)
        net = max(0.0, seg - paused - min(blocked, seg - paused))
        # the step this segment reached: what the next interruption reports, else restart records, else saves
        reached = nxt.step_reached if nxt is not None else None
        if nxt is not None:
            # A record up to 1 s after the resume is this fault's (a slow node's), unless the next fault came first:
            # a group that reached its step fast and failed again within that second records the next one's step.
            after = chain[i + 2].at if i + 2 < len(chain) else float("inf")
            window = [s for t, s in restart_steps
                      if nxt.at - 1.0 <= t <= min((nxt.resumed_at or until) + 1.0, after - 1e-6)]
            reached = _max(reached, max(window, default=None))
        saved = [_int(e.fields.get("step")) for e in evs if e.kind == "checkpoint_saved" and lo <= e.time <= hi]
        reached = _max(reached, max((s for s in saved if s is not None), default=None))
        if nxt is None:
            reached = _max(reached, final_step if end is not None else None)
            reached = _max(reached, current_step)
        if nxt is not None:
            nxt.step_reached = reached
        loaded = g.loaded_step if g.loaded_step is not None else (0 if g.resumed_at is not None else None)
        redo = 0
        if (g is not start or relaunch) and g.step_reached is not None and loaded is not None:
            redo = max(0, g.step_reached - loaded)
        ran = (reached - loaded) if reached is not None and loaded is not None else None
        redo_s = 0.0
        if redo and ran and ran > 0:
            redo_s = min(net, net * redo / ran)
        elif redo:
            redo_s = net  # the group has not yet got past the steps it redoes
        buckets["paused"] += paused
        buckets["checkpoint"] += min(blocked, seg - paused)
        buckets["recomputing"] += redo_s
        buckets["training"] += net - redo_s
        if nxt is None:
            last_reached = reached
        if g is start and not relaunch:
            continue
        prev_lo = chain[i - 1].resumed_at if i and chain[i - 1].resumed_at is not None else t0
        detect = g.at - fault_time(g, prev_lo) if g is not start else 0.0
        join = g.last_join if g.last_join is not None else g.in_place_at
        resumed = g.resumed_at
        restart_s = (min(join, until) if join is not None else until) - g.at
        if g is start and carried is not None:  # a full restart: down since the carried ledger's last write
            g.at = carried["until"]
            restart_s = max(0.0, t0 - g.at) + (min(join, until) if join is not None else until) - t0
        load_s = (min(resumed, until) - join) if resumed is not None and join is not None else 0.0
        buckets["detecting"] += detect
        buckets["restarting"] += restart_s
        buckets["loading"] += max(0.0, load_s)
        complete = resumed is not None and (end is not None or nxt is not None or ran is None
                                            or (ran is not None and ran >= redo))
        faults.append(FaultCost(
            at=g.at, cause=g.cause, kind=g.kind, node=g.node, detection_s=round(detect, 3),
            restart_s=round(restart_s, 3), load_s=round(max(0.0, load_s), 3), recomputed_steps=redo,
            recompute_s=round(redo_s, 3), lost_s=round(detect + restart_s + max(0.0, load_s) + redo_s, 3),
            step_reached=g.step_reached, resumed_step=loaded if resumed is not None else None,
            resumed_at=resumed, complete=complete))
    wall = until - t0
    info = None
    if carried is not None:
        gap = max(0.0, t0 - carried["until"])
        if not relaunch:
            buckets["paused"] += gap  # (a relaunch's gap is in its fault's restart_s, added above)
        for k in BUCKETS:
            buckets[k] += carried["buckets"][k]
        faults = carried["faults"] + faults
        wall += carried["wall_s"] + gap
        info = {k: carried[k] for k in ("started", "until", "wall_s", "url")}
        info["faults"] = len(carried["faults"])
        t0 = carried["started"]
        last_reached = _max(last_reached, carried["step"])
    buckets = {k: round(max(0.0, v), 3) for k, v in buckets.items()}
    return Ledger(started=t0, until=until, wall_s=wall, buckets=buckets, faults=faults, ended=end is not None,
                  carried=info, step=last_reached)


MAX_CARRIED_FAULTS = 500
"""Faults a carried ledger lists (the newest; ~0.4 kB each, one etcd value): older ones stay in its buckets only."""


def carry_record(led: Ledger, run_id: str, url: str = "") -> dict[str, Any]:
    """What a full restart needs to continue `led` (the body of the checkpoint root's `ledger.json`, and the
    fields of the `ledger_carried` event that brings it into a new etcd)."""
    return {"version": 1, "run_id": run_id, "url": url, "started": led.started, "until": led.until,
            "wall_s": round(led.wall_s, 3), "buckets": led.buckets, "ended": led.ended, "step": led.step,
            "faults": [f.to_dict() for f in led.faults[-MAX_CARRIED_FAULTS:]]}


def _carried(carries: list[_Ev], t0: float) -> Optional[dict[str, Any]]:
    """The first well-formed `ledger_carried` event whose life began before this etcd's history (a later one, or
    one of a life this etcd saw, is ignored: the totals count once)."""
    names = {f.name for f in fields(FaultCost)}
    for e in carries:
        c = e.fields
        try:
            started, until, wall = float(c["started"]), float(c["until"]), float(c["wall_s"])
            buckets = {k: float(c["buckets"].get(k, 0.0)) for k in BUCKETS}
            faults = [FaultCost(**{k: v for k, v in f.items() if k in names}) for f in c.get("faults") or []]
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            log.debug("ignoring a malformed %s event: %s", CARRIED_EVENT, err)
            continue
        if started < t0 - 1.0:
            return {"started": started, "until": until, "wall_s": wall, "buckets": buckets, "faults": faults,
                    "ended": bool(c.get("ended")), "step": _int(c.get("step")), "url": str(c.get("url") or "")}
    return None


def window(events: Iterable[Any], *, since: float, until: float, since_step: Optional[int] = None,
           until_step: Optional[int] = None, **kw: Any) -> dict[str, Any]:
    """The ledger over a window [since, until] of a running job: `compute` at `until` (events up to then) less
    `compute` at `since`, bucket by bucket; the faults noticed inside it. `since_step`/`until_step`: the step the
    job had reached at each end (`compute`'s `current_step`); `kw`: the rest of `compute`'s arguments.

    Exact when no fault is open at `since` (a training segment straddling it is split at `since`); a save
    reported within 1 s after `since` counts before it. `productive` = (training + checkpoint) / wall: the
    fraction the goodput benchmark's figure equals when steps run at the fault-free pace (docs/benchmarks.md)."""
    evs = [_ev(e) for e in events]
    kw.pop("now", None)
    kw.pop("current_step", None)
    before = compute([e for e in evs if e.time <= since], now=since, current_step=since_step, **kw)
    after = compute([e for e in evs if e.time <= until], now=until, current_step=until_step, **kw)
    wall = until - since
    b = {k: round(after.buckets[k] - before.buckets[k], 3) for k in BUCKETS}
    faults = [f for f in after.faults if since <= f.at <= until]
    return {"since": since, "until": until, "wall_s": round(wall, 3), "buckets": b,
            "ettr": round(b["training"] / wall, 4) if wall > 0 else None,
            "productive": round((b["training"] + b["checkpoint"]) / wall, 4) if wall > 0 else None,
            "faults": len(faults), "recomputed_steps": sum(f.recomputed_steps for f in faults),
            "lost_s": round(sum(b[k] for k in LOST_BUCKETS), 3)}


def sample_ledger_recomputed(records: Iterable[dict[str, Any]]) -> int:
    """Steps run more than once according to the sample ledger (`runtime/audit.py` records): for each step, the
    launches that ran it, less one. The independent count `compute`'s recomputed steps must equal."""
    launches: dict[int, set[Any]] = {}
    for r in records:
        launches.setdefault(int(r["step"]), set()).add((r["seq"], r["launch"]))
    return sum(len(v) - 1 for v in launches.values())




def for_job(events: Iterable[Any], restarts: Iterable[Any], job: Any, nodes: Iterable[Any], now: float) -> Ledger:
    """`compute` on the records the agents keep in etcd: the event log, the restart records, the JobRecord (None
    when absent) and the NodeStatus of every node."""
    nodes = list(nodes)
    steps = [n.step for n in nodes if n.step is not None]
    return compute(events, restarts=restarts, started=getattr(job, "started", None), now=now,
                   current_step=max(steps) if steps else None, final_step=getattr(job, "steps", None),
                   node_updated={n.node: n.updated for n in nodes})


__all__ = ["BUCKETS", "CARRIED_EVENT", "FAULT_COST_EVENT", "FaultCost", "Ledger", "carry_record", "compute",
           "for_job", "sample_ledger_recomputed", "window"]
