"""`elastictrain status`: the job's state, members, restarts, last checkpoint and recent events.

Exit codes (usable as a liveness probe): 0 healthy; 1 unhealthy (failed, recovering for longer than
--max-recovering, a node that stopped reporting while the job did not re-form without it); 2 error (no such
run, etcd unreachable or refusing us; one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from typing import Any, Optional, TextIO

from elastictrain.agent.jobstate import DEFAULT_MAX_RECOVERING_S, DEFAULT_STALE_AFTER_S, JobView, collect
from elastictrain.cli import target as tgt

EXIT_UNHEALTHY = 1

_HIDDEN_FIELDS = {"time", "node", "agent_pid", "run_id", "pids", "global_ranks", "failures", "workers"}


def _ago(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%H:%M:%S")


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def format_event(e: dict[str, Any]) -> str:
    fields = " ".join(f"{k}={_short(v)}" for k, v in e["fields"].items() if k not in _HIDDEN_FIELDS)
    return f"{_clock(e['time'])}  {e['node']}  {e['kind']}  {fields}".rstrip()


def _short(v: Any, limit: int = 80) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def render(view: JobView) -> str:
    """The human-readable status page."""
    now = view.time
    out = []
    health = "healthy" if view.healthy else "UNHEALTHY"
    since = f" since {_clock(view.since)} ({_ago(now - view.since)} ago)" if view.since else ""
    step = f", step {view.step}" if view.step is not None else ""
    out.append(f"run {view.run_id}: {view.state.upper()} ({health}){since}{step}")
    for p in view.problems:
        out.append(f"  problem: {p}")
    if view.pause_requested and view.state not in ("paused", "pausing"):
        out.append("  note: a pause is requested (elastictrain resume lifts it)")
    r = view.rendezvous
    if r is not None:
        out.append(f"rendezvous: round {r.round}, {'complete' if r.complete else 'forming'}"
                   f"{', closed' if r.closed else ''}, {r.participants} participant(s), {r.waiting} waiting")
    out.append(f"restarts:   {view.restarts_used} of {view.max_restarts} used{_no_progress(view)}")
    c = view.checkpoint
    if c is not None:
        out.append(f"checkpoint: step {c.step}, {_ago(c.age_s)} ago, {c.url}")
    elif not view.checkpoint_url:
        out.append("checkpoint: not configured (checkpoint.url)" if view.checkpoint_checked else "checkpoint: -")
    elif view.checkpoint_checked:
        out.append(f"checkpoint: none valid yet under {view.checkpoint_url}")
    else:
        out.append(f"checkpoint: not checked ({view.checkpoint_url})")
    out += _ledger(view)
    out += _snapshots(view)
    out += _stragglers(view)
    out += _in_place(view)
    if view.last_hang is not None:
        out.append(f"last hang:  {_clock(view.last_hang.time)} ({_ago(now - view.last_hang.time)} ago) "
                   f"{view.last_hang.describe()}")
    out.append("")
    rows = [[m.node, m.host, "-" if m.group_rank is None else str(m.group_rank), m.state,
             f"{m.workers} ({','.join(sorted(set(m.phases))) or '-'})", _ago(m.heartbeat_age_s),
             "-" if m.step is None else str(m.step),
             "-" if m.step_time_s is None else f"{m.step_time_s:.3f}s", _ago(m.updated_age_s)]
            for m in view.members]
    out.append(table(rows, ["NODE", "HOST", "RANK", "STATE", "WORKERS", "HEARTBEAT", "STEP", "STEP TIME",
                            "UPDATED"]))
    if view.events:
        out.append("")
        out.append("recent events:")
        out += [f"  {format_event(e)}" for e in view.events]
    return "\n".join(out)


def _in_place(view: JobView) -> list[str]:
    """The newest recovery in place: who was replaced and why, and the pause (or how long it has lasted)."""
    ip = view.in_place
    if not ip:
        return []
    ranks = ",".join(map(str, ip["replaced_ranks"])) or "-"
    what = f"rank(s) {ranks} replaced by {ip['node']}"
    if ip.get("lost_node"):
        what += f", taking lost node {ip['lost_node']}'s place"
    when = f"{_clock(ip['time'])} ({_ago(view.time - ip['time'])} ago)"
    if not ip["resumed"]:
        return [f"in place:   PAUSED since {when}: {what} (generation {ip['generation']})"]
    pause = "-" if ip["pause_s"] is None else _ago(ip["pause_s"])
    parts = ip.get("pause_parts") or {}
    where = f" ({', '.join(f'{k} {v:.2f}s' for k, v in parts.items())})" if parts and ip["pause_s"] is not None else ""
    cause = f"; {_short(ip['cause'], 60)}" if ip.get("cause") else ""
    return [f"in place:   {when}: {what}, resumed at step {ip['step']} after {pause} paused{where}{cause}"]


LAST_FAULTS = 3
"""Faults whose cost `status` shows (all of them: `elastictrain events --kind fault_cost`)."""


def _ledger(view: JobView) -> list[str]:
    """ETTR, where the wall time went, and what the newest faults cost."""
    led = view.ledger
    if not led or not led.get("wall_s"):
        return []
    b, wall = led["buckets"], led["wall_s"]
    parts = ", ".join(f"{k} {_ago(v)}" for k, v in b.items() if v >= 0.05 and k != "training")
    ettr = led.get("ettr")
    out = [f"ETTR:       {100 * ettr:.1f}% ({_ago(b['training'])} useful training of {_ago(wall)} wall time"
           f"{'; ' + parts if parts else ''})" if ettr is not None else "ETTR:       -"]
    faults = led.get("faults") or []
    if faults:
        lost = sum(f["lost_s"] for f in faults)
        out.append(f"faults:     {len(faults)}, {_ago(lost)} lost, {led.get('recomputed_steps', 0)} step(s) recomputed")
    for f in faults[-LAST_FAULTS:]:
        out.append(f"  {_clock(f['at'])} {f['kind']}: lost {_ago(f['lost_s'])}{'' if f['complete'] else ' so far'} "
                   f"(detect {_ago(f['detection_s'])}, restart {_ago(f['restart_s'])}, load {_ago(f['load_s'])}, "
                   f"recompute {f['recomputed_steps']} step(s) {_ago(f['recompute_s'])}); {_short(f['cause'], 70)}")
    return out


def _snapshots(view: JobView) -> list[str]:
    """One line per node that holds in-memory snapshots: the newest in its RAM, and how far its peer's replica is."""
    out = []
    for m in view.members:
        if m.snapshot_step is None or m.state in ("gone", "left"):
            continue
        if m.replica_peer is None:
            where = "local only (no peer node)"
        elif m.replicated_step is None:
            where = f"not replicated yet (peer {m.replica_peer})"
        else:
            where = f"replicated to {m.replica_peer} up to step {m.replicated_step}"
        out.append(f"snapshot:   {m.node}: step {m.snapshot_step} in node RAM, {where}")
    return out


def _stragglers(view: JobView) -> list[str]:
    """One line per rank named slow now, slowest first."""
    slow = {int(r): info for m in view.members if m.state not in ("gone", "left") for r, info in m.stragglers.items()}
    return [f"straggler:  rank {r}: {info.get('lateness_s', 0):.3f}s late per step "
            f"({100 * (info.get('score') or 0):.0f}% of the step time) since step {info.get('step')}"
            for r, info in sorted(slow.items(), key=lambda kv: -(kv[1].get("lateness_s") or 0))] + _replaced(view)


def _replaced(view: JobView) -> list[str]:
    """The newest straggler replacement of each node that made one (a drained node's record stays), and the count."""
    out = []
    for m in view.members:
        r = m.last_replacement
        if not r:
            continue
        counts = ", ".join(f"{n} {a}" for a, n in sorted(m.stragglers_replaced.items()))
        out.append(f"replaced:   rank {r.get('slow_rank')} on {m.node} ({r.get('action')}) at step {r.get('step')}, "
                   f"{r.get('lateness_s') or 0:.3f}s late per step; this node so far: {counts}")
    return out


def _no_progress(view: JobView) -> str:
    """The restarts in a row without progress, against their limit, and the backoff they cost."""
    if not view.no_progress_restarts or not view.restarts_used:
        return ""
    limit = f" (limit {view.max_no_progress_restarts})" if view.max_no_progress_restarts else ""
    backoff = f", backoff {view.backoff_s:.1f}s" if view.backoff_s else ""
    return f"; {view.no_progress_restarts} in a row without progress{limit}{backoff}"


def _cmd_status(args: argparse.Namespace) -> int:
    target = tgt.connect(args)
    try:
        while True:
            view = collect(target, events=args.events, checkpoint=not args.no_checkpoint,
                           stale_after_s=args.stale_after, max_recovering_s=args.max_recovering)
            _print(view, args.json, sys.stdout, clear=args.watch and not args.json)
            if not args.watch:
                return 0 if view.healthy else EXIT_UNHEALTHY
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        target.close()


def _print(view: JobView, as_json: bool, out: TextIO, clear: bool) -> None:
    if as_json:
        out.write(json.dumps(view.to_dict(), default=str) + "\n")
    else:
        if clear and out.isatty():
            out.write("\x1b[H\x1b[2J")
        out.write(render(view) + "\n")
    out.flush()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="the job's state, members, restarts, last checkpoint, recent events",
                       description=__doc__.split("\n\n")[0] + " Exit 0 healthy, 1 unhealthy, 2 error.")
    tgt.add_target_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object (per refresh with --watch)")
    p.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default %(default)s)")
    p.add_argument("--events", type=int, default=8, metavar="N", help="recent events shown (default %(default)s)")
    p.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint storage listing")
    p.add_argument("--stale-after", type=float, default=DEFAULT_STALE_AFTER_S, metavar="S",
                   help="a node not reporting for S seconds is lost (default %(default)s)")
    p.add_argument("--max-recovering", type=float, default=DEFAULT_MAX_RECOVERING_S, metavar="S",
                   help="recovering for longer than S seconds is unhealthy (default %(default)s)")
    p.set_defaults(func=_cmd_status)
