"""Goodput benchmark: useful steps per second under a fault every X seconds, over fault-free steps per second.

Writes benchmarks/results/goodput.json and goodput.png. Run: `python benchmarks/goodput.py` (defaults: a worker
SIGKILL every 20 s for 120 s after 60 fault-free seconds, 1 round, ours and stock each with default and tuned
settings: ~11 minutes); `--faults worker,node` alternates worker kills and node kills (the node re-joins
`--rejoin-after` seconds later); `--quick` is a smoke run (~2 minutes) that writes under /tmp.

Workload: the one `benchmarks/recovery.py` uses (its `Job`): the reference recipe `elastictrain.recipes.lm` (tiny
Llama, synthetic data, FSDP2 on gloo), 2 nodes x 1 worker on localhost, `--nnodes 1:2`, DCP checkpoint every 10
steps, sample ledger on. "ours" is `elastictrain run` (our agent, real etcd); "stock" is `torchrun --rdzv-backend
c10d` running the same recipe ("stock torchrun + DCP"), each with the settings `--systems` names from
recovery.py's CONFS (`defaults` or `tuned`: short leases, last call and keep-alives).

Each system runs one job per round: once the 2-node group has completed a step (and ours' pre-warmed spare
workers have finished importing: steady state), `--baseline` seconds without faults (its fault-free steps/s),
then a window of `--duration` seconds with the fault schedule. The schedule is seeded and the same for both
systems: fault i at (i+1)*X +- jitter seconds into the window; worker kills hit the worker of node a or b
(seeded), node kills always hit node b (a hosts stock torchrun's c10d store, whose loss ends a c10d job). A
fault waits until its target has live workers (it never fires into a node that is down), but not, unlike
recovery.py, for ours' pre-warmed spare workers to be ready: each event records how many were
(`spares_ready_total`).

Useful steps: the steps of the final committed timeline (`runtime/audit.py` `committed_timeline`: each step from
the newest launch that ran it) up to the newest group's last completed step, counted from the step completed when
the window opened; work a rollback threw away is not counted. Goodput = (useful steps / window seconds) /
fault-free steps/s of the same system and job. Recovery time: fault to the first step completed by a group
launched after it (recovery.py's `recovery_stats`); steps lost: steps the old groups completed that the new one
runs again. Systems alternate order over `--rounds`; the summary holds medians over rounds.

Beside it, for ours: the time ledger the agents kept in etcd (`elastictrain/agent/ledger.py`), read as
`elastictrain status --json` reads it, over the whole job (`ettr_job`) and over the same fault window
(`ledger.window`: its buckets, `ettr`, `productive` = (training + checkpoint) / wall). The relation, tested in
tests/unit/benchmarks/test_goodput_ledger.py: goodput = productive x fault-free step time / step time while training
(the ledger counts a slow step as training, goodput as less work); at the fault-free pace goodput = productive
= ETTR + checkpoint / wall, and steps_thrown_away = the ledger's recomputed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import recovery  # noqa: E402
from benchmarks.recovery import (  # noqa: E402
    CONFS,
    Completed,
    Job,
    _spares_ready,
    _trained,
    recovery_stats,
    unwind_on_sigterm,
)
from elastictrain.agent.budget import RestartBudget  # noqa: E402
from elastictrain.agent.jobstate import collect  # noqa: E402
from elastictrain.agent.ledger import window  # noqa: E402
from elastictrain.agent.status import read_events, read_job  # noqa: E402
from elastictrain.chaos.process_signals import signal_worker  # noqa: E402
from elastictrain.cli.target import JobConnection  # noqa: E402
from elastictrain.rendezvous.client import EtcdClient  # noqa: E402
from elastictrain.rendezvous.embedded import EmbeddedEtcd  # noqa: E402
from elastictrain.rendezvous.settings import EtcdSettings  # noqa: E402
from elastictrain.runtime.audit import committed_timeline  # noqa: E402
from elastictrain.runtime.warmstart import idle_spares  # noqa: E402
from tests.chaos.cluster import GLOBAL_BATCH, Node  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "goodput"
# stock:tuned is kept although it split into two 1-node jobs at every start on the loaded 2-core machine here
DEFAULTS = {"duration": 120.0, "baseline": 60.0, "every": 20.0,
            "systems": "ours:tuned,stock:defaults,ours:defaults,stock:tuned"}
QUICK = {"duration": 24.0, "baseline": 8.0, "every": 12.0, "systems": "ours:tuned,stock:defaults"}
WORKLOAD = ("recipe elastictrain.recipes.lm, tiny Llama (hidden 32, 2 layers; --size: meta.size), synthetic data, "
            "seq 16, global batch 8, FSDP2 on gloo; 2 nodes x 1 worker on localhost (--nnodes 1:2), DCP checkpoint "
            "every 10 steps, sample ledger on (benchmarks/recovery.py Job)")


@dataclass
class Fault:
    at_s: float
    """seconds into the fault window"""
    kind: str
    """"worker" (SIGKILL one worker) or "node" (SIGKILL agent + workers, start it again later)"""
    node: str


def schedule(duration: float, every: float, kinds: list[str], jitter: float, seed: int) -> list[Fault]:
    """Fault i at (i+1)*every +- jitter*every seconds, kinds in turn; the same for every system and round."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    i = 0
    while (i + 1) * every < duration:
        kind = kinds[i % len(kinds)]
        at = (i + 1) * every + rng.uniform(-jitter, jitter) * every
        node = rng.choice("ab") if kind == "worker" else "b"
        faults.append(Fault(round(at, 2), kind, node))
        i += 1
    return faults


def _wait_workers(node: Node, until: float) -> bool:
    while time.monotonic() < until:
        if node.alive() and node.workers():
            return True
        time.sleep(0.05)
    return False


def run_window(job: Job, faults: list[Fault], t0: float, duration: float, rejoin_after: float) -> list[dict]:
    """Fire `faults` (relative to `t0`) until `t0 + duration`; returns what happened, with monotonic times."""
    events: list[dict] = []
    t_end = t0 + duration
    nodes = {n.name: n for n in job.nodes if n.alive()}
    pending_rejoin: Optional[float] = None
    queue = list(faults)
    while time.monotonic() < t_end:
        now = time.monotonic()
        if pending_rejoin is not None and now >= pending_rejoin:
            nodes["b"] = job.start("b")
            events.append({"kind": "rejoin", "node": "b", "time": time.monotonic()})
            pending_rejoin = None
        if queue and now >= t0 + queue[0].at_s:
            f = queue[0]
            node = nodes.get(f.node)
            if node is None:  # not running when the window opened (seen once: KeyError 'b'): it starts at a rejoin
                time.sleep(0.02)
                continue
            # a fault hits running processes: wait for the target's workers (a restart may be under way)
            # unlike recovery.py, no waiting for ours' pre-warmed spares: a steady fault rate hits whatever runs
            spares = {n: list(idle_spares(x.pid)) for n, x in nodes.items()} if job.system == "ours" else None
            if f.kind == "worker" and _wait_workers(node, min(t_end, now + 0.5)):
                try:
                    signal_worker(node.pid, signal.SIGKILL)
                    events.append({"kind": "worker", "node": f.node, "time": time.monotonic(),
                                   "scheduled_s": f.at_s, "spares_ready_total": spares})
                    queue.pop(0)
                except (LookupError, ProcessLookupError):
                    pass  # the worker exited between the lookup and the signal: try again
            elif f.kind == "node" and node.alive() and pending_rejoin is None:
                node.kill()
                events.append({"kind": "node", "node": f.node, "time": time.monotonic(), "scheduled_s": f.at_s,
                               "spares_ready_total": spares})
                pending_rejoin = time.monotonic() + rejoin_after
                queue.pop(0)
        time.sleep(0.02)
    return events


def _split_brain(done: list[Completed]) -> bool:
    """Two 1-rank groups trained during overlapping spans: two jobs, not one."""
    spans: dict[int, list[float]] = {}
    for c in done:
        if c.world == 1:
            s = spans.setdefault(c.seq, [c.time, c.time])
            s[0], s[1] = min(s[0], c.time), max(s[1], c.time)
    ordered = sorted(spans.values())
    return any(b[0] < a[1] for a, b in zip(ordered, ordered[1:]))


def useful(done: list[Completed], at: float) -> tuple[int, int]:
    """(newest launch seq, its last completed step) among the steps completed by time `at`."""
    upto = [c for c in done if c.time <= at]
    seq = max(c.seq for c in upto)
    return seq, max(c.step for c in upto if c.seq == seq)


def check_timeline(samples_dir: Path, last: int) -> dict:
    """Whether the committed timeline up to `last` has every step, full batches, and no sample twice."""
    timeline = {s: v for s, v in committed_timeline(samples_dir).items() if s <= last}
    flat = [x for v in timeline.values() for x in v]
    return {"steps": len(timeline), "missing_steps": sorted(set(range(last + 1)) - set(timeline))[:20],
            "short_steps": sorted(s for s, v in timeline.items() if len(v) != GLOBAL_BATCH)[:20],
            "exactly_once": len(flat) == len(set(flat))}


def analyse(done: list[Completed], events: list[dict], t_base: float, t0: float, t_end: float) -> dict:
    """Rates, goodput and per-fault recovery from the completed steps and the fired events."""
    _, s_base = useful(done, t_base)
    _, s0 = useful(done, t0)
    seq_end, s_end = useful(done, t_end)
    free_rate = (s0 - s_base) / (t0 - t_base)
    fault_rate = (s_end - s0) / (t_end - t0)
    ran = sum(1 for c in done if t0 < c.time <= t_end)
    per_event = []
    for e in events:
        before_seq = max((c.seq for c in done if c.time <= e["time"]), default=-1)
        after = next((c for c in sorted(done, key=lambda c: c.time)
                      if e["time"] < c.time <= t_end and c.seq > before_seq
                      and (e["kind"] != "rejoin" or c.world == 2)), None)
        r = recovery_stats(done, e["time"], after) if after else {
            "recovered": False, "recovery_s": None, "steps_lost": None,
            "note": "no step by a group launched after it before the window closed"}
        per_event.append({"kind": e["kind"], "node": e["node"], "at_s": round(e["time"] - t0, 2),
                          "scheduled_s": e.get("scheduled_s"), **r, "spares_ready_total": e.get("spares_ready_total")})
    faults = [e for e in per_event if e["kind"] != "rejoin"]
    rec = [e["recovery_s"] for e in faults if e["recovered"]]
    lost = [e["steps_lost"] for e in per_event if e["steps_lost"] is not None]
    return {
        "goodput": round(fault_rate / free_rate, 3) if free_rate > 0 else None,
        "steps_per_s_fault_free": round(free_rate, 3), "steps_per_s_under_faults": round(fault_rate, 3),
        "useful_steps": s_end - s0, "steps_run_in_window": ran, "steps_thrown_away": ran - (s_end - s0),
        "window_start_step": s0, "window_end_step": s_end, "final_seq": seq_end,
        "faults_fired": len(faults), "recoveries": len(rec), "median_recovery_s": _median(rec),
        "steps_lost_per_fault": [e["steps_lost"] for e in faults],
        "steps_lost_total": sum(lost), "events": per_event,
        "split_brain": _split_brain([c for c in done if c.time <= t_end]),
    }


def start(system: str, conf: str, work: Path, endpoint: Optional[str], attempts: int,
          pin: bool = False) -> tuple[Job, list[str]]:
    """A job whose 2-node group has completed a step; a start that split in two is killed and tried again.
    `pin`: node a's processes on CPU 0, node b's on CPU 1 (`--pin-nodes`)."""
    failures: list[str] = []
    for i in range(attempts):
        job = Job(system, conf, work / f"start-{i}", endpoint)
        if pin:
            job.pin = {"a": 0, "b": 1}
        job.start_both()
        try:
            if _trained(job, -1, 1):
                return job, failures
            failures.append("no step on 2 nodes within 180 s")
        except AssertionError as e:  # stock c10d under load: the nodes trained as two 1-node jobs
            failures.append(str(e))
        job.close()
    raise RuntimeError(f"{system}:{conf} did not start in {attempts} attempts: {failures}")


def decompose(r: dict, duration: float) -> dict:
    """goodput = uptime x speed x useful fraction, from a round's trace: where the fault-free rate was lost."""
    t = [p[0] for p in r["trace"]]
    base_gaps = sorted(b - a for a, b in zip(t, t[1:]) if b <= 0)
    # a stall is a gap far longer than a fault-free step interval: detection, restart, load
    threshold = max(1.0, 10 * base_gaps[len(base_gaps) // 2]) if base_gaps else 1.0
    window = [0.0, *(x for x in t if 0 < x <= duration), duration]
    stalled = sum(g for g in (b - a for a, b in zip(window, window[1:])) if g > threshold)
    ran = r["steps_run_in_window"]
    rate = ran / (duration - stalled) if duration > stalled else 0.0
    return {"stall_threshold_s": round(threshold, 2), "stalled_s": round(stalled, 2),
            "uptime_fraction": round(1 - stalled / duration, 3),
            "speed_while_training": round(rate / r["steps_per_s_fault_free"], 3),
            "useful_fraction": round(r["useful_steps"] / ran, 3) if ran else None}


def read_time_ledger(job: Job) -> dict:
    """Ours: the job's records in etcd, read while it runs: the ledger as `elastictrain status --json` shows it
    (`jobstate.collect`), and the event log and restart records for `time_ledger`'s window."""
    settings = EtcdSettings.from_conf(str(job.endpoint), job.run_id, {})
    client = EtcdClient(settings)
    try:
        client.connect()
        view = collect(JobConnection(client, settings), events=0, checkpoint=False)
        record = read_job(client, settings.run_prefix)
        return {"status_ledger": view.ledger, "events": read_events(client, settings.run_prefix),
                "restarts": RestartBudget(client, settings.run_prefix).records(),
                "started": record.started if record is not None else None}
    except Exception as e:  # noqa: BLE001 - a side figure: the benchmark's own numbers stand without it
        return {"error": f"could not read the time ledger from etcd: {e}"}
    finally:
        client.close()


def time_ledger(records: dict, wall_offset: float, r: dict, t0: float, t_end: float, duration: float) -> dict:
    """The ledger beside the goodput figure: over the whole job (what `status` showed at the window's end) and over
    the fault window (monotonic `t0`/`t_end` + `wall_offset` = the agents' Unix times)."""
    if "error" in records:
        return {"error": records["error"]}
    led = records["status_ledger"] or {}
    w = window(records["events"], restarts=records["restarts"], started=records["started"],
               since=t0 + wall_offset, until=t_end + wall_offset, since_step=r["window_start_step"] + 1,
               until_step=r["window_end_step"] + 1)
    speed = (r["decomposition"] or {}).get("speed_while_training")
    return {"ettr_job": led.get("ettr"), "wall_s_job": led.get("wall_s"), "buckets_job": led.get("buckets"),
            "faults_job": led.get("faults"),
            "window": w, "ettr_window": w["ettr"], "productive_window": w["productive"],
            "productive_minus_goodput": round(w["productive"] - r["goodput"], 3)
            if w["productive"] is not None and r["goodput"] is not None else None,
            "speed_while_training": speed,
            "productive_x_speed": round(w["productive"] * speed, 3) if w["productive"] is not None and speed else None,
            "recomputed_steps_window": w["recomputed_steps"],
            "steps_thrown_away": r["steps_thrown_away"], "window_s": duration}


def run_system(system: str, conf: str, work: Path, endpoint: Optional[str], faults: list[Fault],
               args: argparse.Namespace) -> dict:
    """One job: fault-free baseline phase, then the fault window; the round's figures and step trace."""
    load_start = round(os.getloadavg()[0], 2)
    wall_offset = time.time() - time.monotonic()
    t_launch = time.monotonic()
    try:
        job, failed_starts = start(system, conf, work, endpoint, args.start_attempts, args.pin_nodes)
    except RuntimeError as e:
        return {"error": str(e), "load_avg_1m": load_start}
    try:
        t_trained = time.monotonic()
        try:
            # the baseline is steady state: ours' spares import once at start (CPU a 2-core host feels), then idle
            _spares_ready(job)
            spares_note = None
        except AssertionError as e:
            spares_note = str(e)
        t_base = time.monotonic()
        time.sleep(args.baseline)
        t0 = time.monotonic()
        events = run_window(job, faults, t0, args.duration, args.rejoin_after)
        t_end = t0 + args.duration
        time.sleep(0.1)  # the watch's last poll before the window's end
        done = job.watch.snapshot()
        records = read_time_ledger(job) if system == "ours" else None
    finally:
        job.close()
    out = analyse(done, events, t_base, t0, t_end)
    out["ledger"] = check_timeline(job.out / "samples", out["window_end_step"])
    out["startup_s"] = round(t_trained - t_launch, 2)
    out["spares_wait_s"] = round(t_base - t_trained, 2)
    if spares_note:
        out["spares_note"] = spares_note
    out["failed_starts"] = failed_starts
    out["load_avg_1m"] = [load_start, round(os.getloadavg()[0], 2)]
    out["trace"] = [[round(c.time - t0, 2), c.step, c.world] for c in sorted(done, key=lambda c: c.time)
                    if t_base <= c.time <= t_end]
    out["decomposition"] = decompose(out, args.duration)
    if records is not None:
        out["time_ledger"] = time_ledger(records, wall_offset, out, t0, t_end, args.duration)
    return out


def _median(xs: list[float]) -> Optional[float]:
    return round(statistics.median(xs), 3) if xs else None


def summarize(rounds: list[dict], systems: list[str]) -> dict:
    """Per system: medians over the rounds that ran as one job (no error, no split brain)."""
    out: dict[str, dict] = {}
    for s in systems:
        rs = [r[s] for r in rounds if "error" not in r[s] and not r[s]["split_brain"]]
        out[s] = {"rounds_ok": f"{len(rs)}/{len(rounds)}"}
        for key in ("goodput", "steps_per_s_fault_free", "steps_per_s_under_faults", "median_recovery_s",
                    "faults_fired", "recoveries", "steps_thrown_away", "steps_lost_total"):
            out[s][key] = _median([r[key] for r in rs if r[key] is not None])
        for key in ("uptime_fraction", "speed_while_training", "useful_fraction"):
            out[s][key] = _median([r["decomposition"][key] for r in rs if r["decomposition"][key] is not None])
        for key in ("ettr_job", "ettr_window", "productive_window", "productive_x_speed", "productive_minus_goodput"):
            got = [r["time_ledger"].get(key) for r in rs if "time_ledger" in r]
            if got:
                out[s][f"time_ledger_{key}"] = _median([x for x in got if x is not None])
        out[s]["steps_lost_per_fault_median"] = _median([x for r in rs for x in r["steps_lost_per_fault"]
                                                         if x is not None])
        out[s]["split_brain_rounds"] = sum(1 for r in rounds if r[s].get("split_brain"))
        out[s]["failed_starts"] = sum(len(r[s].get("failed_starts", [])) for r in rounds)
    # goodput divides each system by itself; these say how the absolute rates compare between systems
    for o in (s for s in systems if s.startswith("ours")):
        for st in (s for s in systems if s.startswith("stock")):
            a, b = out[o], out[st]
            out[f"{o} / {st}"] = {k: round(a[k] / b[k], 2) if a[k] and b[k] else None
                                  for k in ("steps_per_s_under_faults", "steps_per_s_fault_free", "goodput")}
    return out


def _git() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "benchmarks/*.py", "elastictrain"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def plot(result: dict, path: Path) -> None:
    """Completed step vs wall time, one panel per system (round 1), with fault markers and a fault-free line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s in result["meta"]["systems"] if "error" not in result["rounds"][0][s]]
    fig, axes = plt.subplots(len(systems), 1, figsize=(10, 3.6 * len(systems)), sharex=True, squeeze=False)
    settings = result["meta"]["settings"]
    names = {"ours": "elastictrain run (our agent, etcd)", "stock": "stock torchrun (c10d) + DCP"}
    colors = {"ours": "tab:blue", "stock": "tab:orange"}
    marks = {"worker": ("tab:red", "-", "worker SIGKILL"), "node": ("tab:purple", "--", "node SIGKILL"),
             "rejoin": ("tab:green", ":", "node re-joins")}
    for ax, s in zip(axes[:, 0], systems):
        r = result["rounds"][0][s]
        t = [p[0] for p in r["trace"]]
        steps = [p[1] for p in r["trace"]]
        ax.axvspan(-settings["baseline_s"], 0, color="0.92", label="fault-free phase (baseline)")
        ax.plot(t, steps, ".", ms=3, color=colors.get(s.split(":")[0], "k"), label="completed step")
        s0, rate = r["window_start_step"], r["steps_per_s_fault_free"]
        x = [-settings["baseline_s"], settings["duration_s"]]
        ax.plot(x, [s0 + rate * v for v in x], "k--", lw=1, label=f"fault-free rate ({rate:.2f} steps/s)")
        for e in r["events"]:
            c, ls, lab = marks[e["kind"]]
            ax.axvline(e["at_s"], color=c, ls=ls, lw=1.2, label=lab)
        rec = f"{r['median_recovery_s']} s" if r["median_recovery_s"] is not None else "n/a"
        d = r.get("decomposition") or {}
        split = "  SPLIT BRAIN: two 1-node jobs" if r["split_brain"] else ""
        ax.set_title(f"{names[s.split(':')[0]]}, {s.split(':')[1]}: goodput {r['goodput']} = uptime "
                     f"{d.get('uptime_fraction')} x speed {d.get('speed_while_training')} x useful "
                     f"{d.get('useful_fraction')}{split}\n({r['steps_per_s_under_faults']} useful steps/s under "
                     f"faults; {r['faults_fired']} faults, {r['recoveries']} recovered, median recovery {rec})",
                     fontsize=10)
        ax.set_ylabel("completed step")
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        seen = dict(zip(labels, handles))  # one legend entry per kind of marker
        ax.legend(seen.values(), seen.keys(), loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("wall time since the fault window opened (s)")
    fig.suptitle(f"Goodput, fault every {settings['every_s']:.0f} s ({settings['faults']}), "
                 f"{result['meta']['date'][:10]}, load avg {result['meta']['load_avg_at_start'][0]:.1f}; "
                 f"round 1 of {len(result['rounds'])} (every round and the medians are in the JSON)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _dumps(result: dict) -> str:
    """Indented JSON with each step trace on one line (thousands of points)."""
    traces: dict[str, list] = {}
    for i, r in enumerate(result["rounds"]):
        for s, v in r.items():
            if isinstance(v, dict) and "trace" in v:
                traces[f"@trace-{i}-{s}@"] = v["trace"]
                v["trace"] = f"@trace-{i}-{s}@"
    text = json.dumps(result, indent=1)
    for i, r in enumerate(result["rounds"]):
        for s, v in r.items():
            key = f"@trace-{i}-{s}@"
            if key in traces:
                v["trace"] = traces[key]
                text = text.replace(json.dumps(key), json.dumps(traces[key], separators=(",", ":")))
    return text + "\n"


def main() -> None:
    unwind_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, help=f"seconds of the fault window per system and round "
                   f"({DEFAULTS['duration']:.0f})")
    p.add_argument("--baseline", type=float, help=f"fault-free seconds before the window ({DEFAULTS['baseline']:.0f})")
    p.add_argument("--every", type=float, help=f"seconds between faults ({DEFAULTS['every']:.0f})")
    p.add_argument("--jitter", type=float, default=0.25, help="fault times vary by +- this fraction of --every")
    p.add_argument("--faults", default="worker", help="kinds in turn: worker, node (node kill + re-join)")
    p.add_argument("--rejoin-after", type=float, default=5.0, help="seconds from a node kill to its restart")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--pin-nodes", action="store_true",
                   help="node a's agent and workers on CPU 0, node b's on CPU 1 (taskset; needs 2 CPUs): the two "
                        "simulated nodes no longer share cores, as separate hosts do not (a restarted node's imports "
                        "then cannot slow the survivor); etcd and this driver run on either")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", help=f"system:conf list, confs from recovery.py's CONFS ({DEFAULTS['systems']})")
    p.add_argument("--start-attempts", type=int, default=3, help="starts tried when a job splits into two")
    p.add_argument("--size", default="tiny", help="the model, of scale.py's SIZES (tiny, 50m, 150m; default tiny: "
                   "the chaos tests' model and data); another size also takes scale.py's data shape")
    p.add_argument("--quick", action="store_true", help=f"smoke run: defaults {QUICK}, output under /tmp")
    p.add_argument("--out", help="output path without suffix (default benchmarks/results/goodput)")
    p.add_argument("--plot-only", action="store_true", help="recompute the summary and redraw the PNG from the "
                   "rounds of the existing JSON")
    p.add_argument("--keep", help="keep each job's logs, ledgers and checkpoints under this directory")
    p.add_argument("--note", default="", help="free text kept in meta.note (what else ran, what changed)")
    args = p.parse_args()
    for k, v in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "goodput-quick" if args.quick else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        result = json.loads(out.with_suffix(".json").read_text())
        for r in result["rounds"]:
            for v in r.values():
                if isinstance(v, dict) and "trace" in v:
                    v["decomposition"] = decompose(v, result["meta"]["settings"]["duration_s"])
        result["summary"] = summarize(result["rounds"], result["meta"]["systems"])
        result["meta"]["summary_recomputed"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                                "git": _git()}
        out.with_suffix(".json").write_text(_dumps(result))
        plot(result, out.with_suffix(".png"))
        return
    from benchmarks.scale import DATA, SIZES, model_size

    if args.size not in SIZES:
        p.error(f"--size takes one of {', '.join(SIZES)}, not {args.size!r}")
    if args.size != "tiny":
        recovery.EXTRA_SETS[:] = [*(f"model.overrides.{k}={v}" for k, v in SIZES[args.size].items()), *DATA]
    kinds = args.faults.split(",")
    if not set(kinds) <= {"worker", "node"}:
        p.error(f"--faults takes worker and/or node, not {args.faults!r}")
    systems = args.systems.split(",")
    for s in systems:
        name, _, conf = s.partition(":")
        if conf not in CONFS.get(name, {}):
            p.error(f"--systems: {s!r} is not system:conf with system in {sorted(CONFS)} and conf in "
                    f"{sorted(CONFS['ours'])}")
    faults = schedule(args.duration, args.every, kinds, args.jitter, args.seed)
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/goodput.py", *sys.argv[1:]]),
        "git": _git(), "torch": torch.__version__, "python": sys.version.split()[0], "cpus": psutil.cpu_count(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "note": args.note, "workload": WORKLOAD, "systems": systems,
        "size": {"name": args.size, **model_size(args.size), "sets": list(recovery.EXTRA_SETS)},
        "confs": {s: CONFS[s.split(":")[0]][s.split(":")[1]] for s in systems},
        "settings": {"duration_s": args.duration, "baseline_s": args.baseline, "every_s": args.every,
                     "jitter": args.jitter, "faults": args.faults, "rejoin_after_s": args.rejoin_after,
                     "rounds": args.rounds, "seed": args.seed, "quick": args.quick, "pin_nodes": args.pin_nodes},
        "schedule": [asdict(f) for f in faults],
        "metric": "goodput = useful steps per second in the fault window / fault-free steps per second of the same "
                  "job; useful = steps of the final committed timeline (newest launch per step) completed in the "
                  "window; recovery_s = fault to the first step completed by a group launched after it; "
                  "steps_lost = steps completed before the fault that the new group ran again; decomposition: "
                  "goodput = uptime_fraction (window time not in stalls, gaps between steps > stall_threshold_s) "
                  "x speed_while_training (steps run per unstalled second / fault-free rate) x useful_fraction "
                  "(useful / steps run); time_ledger (ours): the agents' time ledger from etcd as `status --json` "
                  "reads it, whole job (ettr_job) and the same window (ettr_window; productive_window = (training + "
                  "checkpoint) / window: goodput = productive_window x fault-free step time / step time while "
                  "training)",
        "trace": "per round and system: [seconds since the fault window opened, completed step, world size] for "
                 "every step completed by all ranks of its group, from the baseline phase (negative times) on",
    }
    rounds: list[dict] = []
    t_start = time.monotonic()
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory(prefix="goodput-bench-") as tmp:
        if args.keep:  # node logs, ledgers and checkpoints stay there for a post-mortem
            os.makedirs(args.keep, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix="goodput-bench-", dir=args.keep)
            meta["kept"] = tmp
        for i in range(args.rounds):
            order = systems if i % 2 == 0 else systems[::-1]
            rounds.append({"order": order})
            for s in order:
                name, conf = s.split(":")
                r = run_system(name, conf, Path(tmp) / f"{name}-{conf}-{i}",
                               etcd.endpoint if name == "ours" else None, faults, args)
                rounds[-1][s] = r
                brief = {k: v for k, v in r.items() if k not in ("trace", "events")}
                print(json.dumps({"round": i, "system": s, **brief}), flush=True)  # noqa: T201 - progress
    meta["wall_s"] = round(time.monotonic() - t_start, 1)
    meta["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result = {"meta": meta, "summary": summarize(rounds, systems), "rounds": rounds}
    out.with_suffix(".json").write_text(_dumps(result))
    if any("error" not in rounds[0][s] for s in systems):
        plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and .png", flush=True)  # noqa: T201


if __name__ == "__main__":
    main()
