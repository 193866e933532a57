"""Recovery benchmark: `elastictrain run` (our agent + etcd3) vs stock torchrun (c10d), same workload, same run.

Writes benchmarks/results/recovery.json (or `--out`). Run: `python benchmarks/recovery.py [--trials 2]`.

Workload: the reference recipe (tiny Llama, synthetic data, FSDP2 on gloo; the chaos tests' FAST settings), 2 nodes
x 1 worker on localhost, `--nnodes 1:2`, checkpoint every 10 steps, sample ledger on. Progress is read from the
workers' sample ledgers (one JSON line per rank per step), polled every 20 ms; a step is *completed* when every
rank of its group has written it. Each trial runs two jobs per configuration:

* job 1: (a) SIGKILL the worker of node b; then, 10 steps into the new group, (d) SIGSTOP the worker of node b.
* job 2: (b) SIGKILL node b (agent and worker); then, once the survivor trains alone, (c) start node b again
  with the same command.

Figures: (a), (b), (d): seconds from the signal to the first step completed by a group launched after it; (c):
seconds from the re-joining node's start to the first completed step of a 2-node group. Steps lost: steps the
old group had completed that the new one runs again. Stock torchrun is given `--max-restarts`, the same
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` and `--monitor-interval 0.1`; node b is never the c10d store host
(killing that one ends a c10d job). Before each fault, ours waits until its pre-warmed spare workers have
finished importing (they do so within seconds of a group starting to train; real faults are far rarer), so each
figure is the steady-state recovery. Then, for both systems alike, faults (a), (b) and (d) wait until the
running group has completed exactly `--fault-offset` steps past the newest committed checkpoint, so that both
lose the same steps by construction (benchmarks/fault_point.py); each entry records that checkpoint and the
offset it fired at. (c) is not
tied to the interval: the group that the node re-joins saves the step it stops at.
A fault counts as "not detected" when no new group completes a step within
`--hang-wait` (default 60 s); every process is then killed by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fault_point import arm_node_kill, arm_worker_signal, at_offset  # noqa: E402
from elastictrain.agent.snapshots import snapshot_base, sweep_orphans  # noqa: E402
from elastictrain.rendezvous.embedded import EmbeddedEtcd  # noqa: E402
from elastictrain.runtime.warmstart import idle_spares  # noqa: E402
from tests.chaos.cluster import Node  # noqa: E402
from tests.integration.recipe_runs import FAST, worker_env  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "recovery.json"
CONFIG = str(ROOT / "configs" / "tiny-cpu.yaml")
CKPT_EVERY = 10
"""checkpoint.every_steps of every job"""
FAULT_OFFSET = 5
"""Default --fault-offset: mid-interval, so a checkpoint's async commit has landed well before the fault."""

EXTRA_SETS: list[str] = []
"""More `--set`s for every job, after FAST's (later ones win): goodput.py's `--size` puts a bigger model's shape and
scale.py's data shape here."""

CONFS: dict[str, dict] = {
    "ours": {
        # elastic.* defaults of the config: lease_ttl 5 s, join grace (last call) 10 s, hang floor 30 s
        "defaults": [],
        "tuned": ["--rdzv-conf", "lease_ttl=2,last_call_timeout=1,join_timeout=120", "--heartbeat-timeout", "3"],
        # tuned, with in-memory snapshots every step: a restart resumes from the step before the fault (#14)
        "snapshot": ["--rdzv-conf", "lease_ttl=2,last_call_timeout=1,join_timeout=120", "--heartbeat-timeout", "3",
                     "--set", "checkpoint.snapshot_every_steps=1"],
        # the same, recovering in place: a killed worker is replaced alone, its peers keep their processes (#15)
        "in-place": ["--rdzv-conf", "lease_ttl=2,last_call_timeout=1,join_timeout=120", "--heartbeat-timeout", "3",
                     "--set", "checkpoint.snapshot_every_steps=1", "--set", "elastic.in_place=true"],
        # the same, and a lost node's place held 15 s: a node started again takes it in place, no new round (#15)
        "in-place-rejoin": ["--rdzv-conf", "lease_ttl=2,last_call_timeout=15,join_timeout=120,rejoin_wait=15",
                            "--heartbeat-timeout", "3", "--set", "checkpoint.snapshot_every_steps=1",
                            "--set", "elastic.in_place=true"],
    },
    "stock": {  # --rdzv-conf values (plus is_host, see Job.command)
        "defaults": "",
        # the tuning behind the design's 9.9 s (benchmarks/rendezvous.py): short last call and heartbeats
        "tuned": "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2",
    },
}


@dataclass
class Completed:
    time: float
    seq: int
    step: int
    world: int


class LedgerWatch:
    """Polls the sample ledgers and timestamps each step when its last rank writes it."""

    def __init__(self, directory: Path, interval: float = 0.02):
        self.dir, self.interval = directory, interval
        self._offsets: dict[Path, int] = {}
        self._ranks: dict[tuple[int, int], set[int]] = {}
        self._world: dict[tuple[int, int], int] = {}
        self.completed: list[Completed] = []
        self.first: dict[int, int] = {}
        """launch seq -> the first step its group completed"""
        self._newest: Optional[Completed] = None
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            time.sleep(self.interval)

    def poll(self) -> None:
        """Read what the ledgers gained since the last read (also called by a waiter that needs it sooner)."""
        with self._read_lock:
            self._read()

    def _read(self) -> None:
        now = time.monotonic()
        for path in sorted(self.dir.glob("rank*.jsonl")) if self.dir.exists() else []:
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written is read next time
            self._offsets[path] = self._offsets.get(path, 0) + end
            for line in data[:end].splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                key = (r["seq"], r["step"])
                with self._lock:
                    ranks = self._ranks.setdefault(key, set())
                    ranks.add(r["rank"])
                    self._world[key] = r["world_size"]
                    if len(ranks) == r["world_size"]:
                        c = Completed(now, r["seq"], r["step"], r["world_size"])
                        self.completed.append(c)
                        self.first[r["seq"]] = min(self.first.get(r["seq"], r["step"]), r["step"])
                        if self._newest is None or (c.seq, c.step) > (self._newest.seq, self._newest.step):
                            self._newest = c

    def snapshot(self) -> list[Completed]:
        with self._lock:
            return list(self.completed)

    def newest(self) -> Optional[Completed]:
        """The newest step (by launch, then step) that every rank of its group completed."""
        with self._lock:
            return self._newest

    def wait(self, pred, timeout: float, nodes: list[Node], abort=None) -> Optional[Completed]:
        """The first completed step matching `pred`, or None after `timeout`, when every node exited or `abort()`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for c in self.snapshot():
                if pred(c):
                    return c
            if not any(n.alive() for n in nodes) or (abort is not None and abort()):
                return None
            time.sleep(0.02)
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Job:
    def __init__(self, system: str, conf: str, work: Path, endpoint: Optional[str]):
        self.system, self.conf, self.work = system, conf, work
        self.out = work / "out"
        self.out.mkdir(parents=True)
        self.run_id = f"rec-{uuid.uuid4().hex[:8]}"
        self.endpoint = endpoint
        self.port = _free_port()
        self.nodes: list[Node] = []
        self.watch = LedgerWatch(self.out / "samples")
        self.pin: dict[str, int] = {}
        """Node name -> the CPU its agent and workers run on (`taskset`; their children inherit it): each simulated
        node on cores of its own, as separate hosts are. Empty: every process on every CPU."""

    def command(self, name: str) -> list[str]:
        sets = [*FAST, *EXTRA_SETS, f"train.output_dir={self.out}", f"checkpoint.url={self.out}/ckpt",
                f"checkpoint.every_steps={CKPT_EVERY}",
                "checkpoint.keep_last=2", "train.steps=100000", "train.audit_samples=true"]
        flags = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "100"]
        if self.system == "ours":
            cmd = [sys.executable, "-m", "elastictrain.cli.main", "run", "--config", CONFIG]
            for s in sets:
                cmd += ["--set", s]
            return cmd + [*flags, "--rdzv-endpoint", str(self.endpoint), "--rdzv-id", self.run_id,
                          *CONFS["ours"][self.conf]]
        # On one host every agent matches the endpoint and may start a store of its own: two 1-node jobs
        # (seen: both nodes trained alone). Only "a" hosts it, as only the endpoint's host would on real nodes.
        conf = ",".join(filter(None, [CONFS["stock"][self.conf], "is_host=" + ("true" if name == "a" else "false")]))
        cmd = [sys.executable, "-m", "torch.distributed.run", *flags, "--monitor-interval", "0.1",
               "--log-dir", str(self.out / f"torchelastic-{name}-{len(self.nodes)}"),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.run_id,
               "--rdzv-conf", conf, "-m", "elastictrain.recipes.lm", "--config", CONFIG]
        for s in sets:
            cmd += ["--set", s]
        return cmd

    def start(self, name: str) -> Node:
        cmd = self.command(name)
        if name in self.pin:
            cmd = ["taskset", "-c", str(self.pin[name]), *cmd]  # taskset execs the command: same pid, same group
        node = Node(name, cmd, worker_env(), self.out / f"{name}-{len(self.nodes)}.log")
        self.nodes.append(node)
        return node

    def start_both(self) -> tuple[Node, Node]:
        a = self.start("a")
        if self.system == "stock":
            # "a" is the c10d store host. If "b" forms a 1-node group first, stock torchrun may never admit
            # "a" (seen twice under load: no 2-node step within 180 s), so "a" starts rendezvous first.
            deadline = time.monotonic() + 60
            while not _listening(a.pid, self.port) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            time.sleep(1.0)
        b = self.start("b")
        return a, b

    def close(self) -> None:
        self.watch.close()
        for n in self.nodes:
            if n.alive():
                n.kill()
        sweep_orphans(snapshot_base())  # a SIGKILLed agent cannot remove its own folder (2 x 2.3 GB at 50M)


def _newest(job: Job) -> Completed:
    newest = job.watch.newest()
    assert newest is not None, "no step completed yet"
    return newest


def _at_offset(job: Job, offset: int) -> tuple[Completed, dict]:
    return at_offset(job.watch, job.out / "ckpt", offset, alive=lambda: any(n.alive() for n in job.nodes))


def _measure(job: Job, fault_at: float, before: Completed, timeout: float, world: Optional[int] = None,
             where: Optional[dict] = None) -> dict:
    """`where`: the checkpoint and offset the fault fired at (from `at_offset`), kept with the figures."""
    where = where or {}
    after = job.watch.wait(lambda c: c.seq > before.seq and (world is None or c.world == world), timeout, job.nodes)
    if after is None:
        return {**where, "recovered": False, "recovery_s": None, "steps_lost": None,
                "note": f"no step by a new group within {timeout:.0f} s (not detected / not recovered)"}
    return {**where, **recovery_stats(job.watch.snapshot(), fault_at, after)}


def recovery_stats(done: list[Completed], fault_at: float, after: Completed) -> dict:
    """Seconds from a fault to `after` (the first step of the group launched after it), the stall, steps lost.

    The stall is the time the job completed no step around the fault: from the last step of an older group
    (or the fault, if that came later) to `after`. It is what a re-join costs the running job: a node that
    starts takes seconds to import before it can join, and whether the running group trains meanwhile is
    the difference the stall shows.
    """
    first = min((c for c in done if c.seq == after.seq), key=lambda c: c.step)
    # the furthest any earlier group got; the new group starts again from its checkpoint
    older = [c for c in done if c.seq < after.seq]
    reached = max(c.step for c in older)
    last_old = max((c.time for c in older if c.time <= after.time), default=fault_at)
    return {"recovered": True, "recovery_s": round(after.time - fault_at, 2),
            "stall_s": round(after.time - max(last_old, fault_at), 2),
            "steps_lost": max(0, reached + 1 - first.step), "resumed_at_step": first.step, "world": after.world}


def _trained(job: Job, after_seq: int, steps: int, world: int = 2) -> bool:
    """Wait until a group launched after `after_seq` on `world` ranks has completed `steps` steps."""
    def pred(c: Completed) -> bool:
        return c.seq > after_seq and c.world == world and c.step - job.watch.first[c.seq] + 1 >= steps
    found = job.watch.wait(pred, 180, job.nodes, abort=lambda: _split(job))
    assert not _split(job), ("split brain: two 1-node groups trained at the same time, each on its own "
                             "(both wrote the shared checkpoint directory)")
    return found is not None


def _split(job: Job) -> bool:
    """Two groups of one rank each completed a step within the same second: two jobs, not one."""
    recent: dict[int, float] = {}
    for c in job.watch.snapshot():
        if c.world == 1:
            recent[c.seq] = c.time
    times = sorted(recent.values())
    return len(times) >= 2 and any(b - a < 1.0 for a, b in zip(times, times[1:])) and \
        all(t > time.monotonic() - 2.0 for t in times[-2:])


def _spares_ready(job: Job, timeout: float = 120.0) -> None:
    """Ours: wait until every live node's pre-warmed spares finished importing (faults are rarer than that)."""
    if job.system != "ours":
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [idle_spares(n.pid) for n in job.nodes if n.alive()]
        if all(total and ready == total for ready, total in states):
            return
        time.sleep(0.1)
    raise AssertionError(f"spare workers not ready within {timeout:.0f} s")


def job_worker_faults(out: dict, system: str, conf: str, work: Path, endpoint: Optional[str], hang_wait: float,
                      timeout: float, offset: int) -> None:
    """(a) SIGKILL node b's worker, then (d) SIGSTOP it once a 2-rank group trains again."""
    job = Job(system, conf, work, endpoint)
    try:
        _, b = job.start_both()
        assert _trained(job, -1, 12), "the job never trained on 2 nodes"
        _spares_ready(job)
        fire = arm_worker_signal(b.pid, signal.SIGKILL)
        before, where = _at_offset(job, offset)
        t = time.monotonic()
        fire()
        out["worker_kill"] = _measure(job, t, before, timeout, where=where)
        if not out["worker_kill"]["recovered"]:
            return
        # the hang detector calibrates on >= 5 steps of the new group first
        assert _trained(job, before.seq, 8), "no 2-rank group trained after the worker kill"
        _spares_ready(job)
        fire = arm_worker_signal(b.pid, signal.SIGSTOP)
        before, where = _at_offset(job, offset)
        t = time.monotonic()
        fire()
        out["hang"] = _measure(job, t, before, hang_wait, where=where)
    finally:
        job.close()


def job_node_faults(out: dict, system: str, conf: str, work: Path, endpoint: Optional[str], hang_wait: float,
                    timeout: float, offset: int) -> None:
    """(b) SIGKILL node b (agent and worker), then (c) start it again once the survivor trains alone."""
    job = Job(system, conf, work, endpoint)
    try:
        _, b = job.start_both()
        assert _trained(job, -1, 12), "the job never trained on 2 nodes"
        _spares_ready(job)
        fire = arm_node_kill(b.pid)  # Node starts each agent in a session of its own
        before, where = _at_offset(job, offset)
        t = time.monotonic()
        fire()
        b.kill()  # reaps it, and whatever started after the look-up
        out["node_loss"] = _measure(job, t, before, timeout, where=where)
        if not out["node_loss"]["recovered"]:
            return
        assert _trained(job, before.seq, 5, world=1), "the survivor did not train alone"
        _spares_ready(job)
        before = _newest(job)
        t = time.monotonic()
        job.start("b")
        out["rejoin"] = _measure(job, t, before, timeout, world=2)
    finally:
        job.close()


def _listening(pid: int, port: int) -> bool:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _median(xs: list[float]) -> Optional[float]:
    return round(statistics.median(xs), 2) if xs else None


def summarize(runs: list[dict], plan: list[tuple[str, str]]) -> tuple[dict, dict, dict]:
    """Per fault and configuration: median seconds and steps lost; stock/ours ratios of the medians; steps lost
    per fault and system (both confs)."""
    runs = [r for r in runs if not r.get("excluded_from_summary")]
    summary: dict[str, dict] = {}
    for fault in ("worker_kill", "node_loss", "rejoin", "hang"):
        summary[fault] = {}
        for system, conf in plan:
            rs = [r for r in runs if r["fault"] == fault and r["system"] == system and r["conf"] == conf]
            secs = [r["recovery_s"] for r in rs if r.get("recovered")]
            stalls = [r["stall_s"] for r in rs if r.get("recovered") and r.get("stall_s") is not None]
            lost = [r["steps_lost"] for r in rs if r.get("recovered") and r.get("steps_lost") is not None]
            summary[fault][f"{system}:{conf}"] = {
                "median_s": _median(secs), "runs_s": [r.get("recovery_s") for r in rs],
                "stall_median_s": _median(stalls),
                "recovered": f"{len(secs)}/{len(rs)}", "steps_lost_median": _median(lost),
                "steps_lost": [r.get("steps_lost") for r in rs], "fault_offsets": [r.get("fault_offset") for r in rs]}
    ratios: dict[str, dict] = {}
    for fault, by in summary.items():
        ratios[fault] = {}
        for conf in ("defaults", "tuned"):
            ratios[fault][conf] = _ratio(by.get(f"ours:{conf}"), by.get(f"stock:{conf}"), "median_s")
            ratios[fault][f"{conf}_stall"] = _ratio(by.get(f"ours:{conf}"), by.get(f"stock:{conf}"),
                                                    "stall_median_s")
    return summary, ratios, steps_lost_by_system(runs)


def steps_lost_by_system(runs: list[dict]) -> dict[str, dict]:
    """Per fault and system, both confs together: the steps lost and the offsets the faults fired at.

    A system that never recovered from a fault lost no step measurably, and has none listed."""
    out: dict[str, dict] = {}
    for fault in ("worker_kill", "node_loss", "hang"):
        out[fault] = {}
        for system in sorted({r["system"] for r in runs}):
            rs = [r for r in runs if r["fault"] == fault and r["system"] == system and r.get("recovered")]
            lost = [r["steps_lost"] for r in rs if r.get("steps_lost") is not None]
            out[fault][system] = {"steps_lost_median": _median(lost), "steps_lost": lost,
                                  "fault_offsets": [r.get("fault_offset") for r in rs]}
    return out


def _ratio(ours: Optional[dict], stock: Optional[dict], key: str):
    """stock / ours of one summary figure; None where either side has no measurement."""
    if not ours or not stock or ours[key] is None or stock["recovered"].endswith("/0"):
        return None
    if stock[key] is None:
        return "stock never recovered within the bound"
    return round(stock[key] / ours[key], 2) if ours[key] > 0 else None


def write_results(runs: list[dict], plan: list[tuple[str, str]], meta: dict, out: Path = RESULTS) -> None:
    summary, ratios, lost = summarize(runs, plan)
    result = {
        "meta": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(), "cpus": psutil.cpu_count(),
            "workload": "recipe elastictrain.recipes.lm, tiny Llama (hidden 32, 2 layers), synthetic data, seq 16, "
                        "global batch 8, FSDP2 on gloo; 2 nodes x 1 worker on localhost, checkpoint every 10 steps",
            "metric": "recovery_s: seconds from the fault to the first step completed (by every rank) of a group "
                      "launched after it; rejoin: from the node's start to the first completed step of the 2-node "
                      "group. stall_s: seconds without a completed step around the fault (from the last step of an "
                      "older group, or the fault if later, to that first step). steps_lost: steps the old group "
                      "completed that the new one ran again; fault_offset: steps the running group had completed "
                      "past the newest committed checkpoint (ckpt_step) when the fault fired (worker_kill, "
                      "node_loss, hang: the same for every system, fault_offset_steps)",
            "checkpoint_every_steps": CKPT_EVERY,
            "confs": CONFS,
            **meta,
        },
        "summary": summary,
        "speedup_stock_over_ours": ratios,
        "steps_lost_by_system": lost,
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")  # noqa: T201


def unwind_on_sigterm() -> None:
    """SIGTERM (a `kill`, a scheduler) unwinds like Ctrl-C, so every job's `close()` stops its agents, workers and
    etcd by PID instead of leaving them running (with their snapshot folders) after the driver is gone."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def main() -> None:
    unwind_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--hang-wait", type=float, default=60.0, help="bound on waiting for a hang to be recovered")
    p.add_argument("--timeout", type=float, default=90.0, help="bound on waiting for other recoveries")
    p.add_argument("--systems", default="ours:tuned,stock:tuned,ours:defaults,stock:defaults")
    p.add_argument("--kinds", default="worker,node",
                   help="jobs per system and trial: worker (kill, then hang), node (loss, then re-join)")
    p.add_argument("--fault-offset", type=int, default=FAULT_OFFSET,
                   help=f"steps past the newest committed checkpoint at which every fault but the re-join fires "
                        f"(1..{CKPT_EVERY - 1}; default %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON (default %(default)s)")
    p.add_argument("--from-log", help="only rebuild the JSON from the entries a previous run printed")
    p.add_argument("--extra-log", help="with --from-log: entries of another pass, kept in runs, not summarized")
    args = p.parse_args()
    if not 1 <= args.fault_offset < CKPT_EVERY:
        p.error(f"--fault-offset must be 1..{CKPT_EVERY - 1} (checkpoints every {CKPT_EVERY} steps)")
    plan = [tuple(s.split(":")) for s in args.systems.split(",")]
    jobs = {"worker": job_worker_faults, "node": job_node_faults}
    kinds = args.kinds.split(",")
    if not set(kinds) <= set(jobs):
        p.error(f"--kinds: choose from {','.join(jobs)}")
    meta = {"hang_wait_s": args.hang_wait, "timeout_s": args.timeout, "fault_offset_steps": args.fault_offset,
            "kinds": kinds, "load_avg_at_start": os.getloadavg()}
    if args.from_log:
        runs = [json.loads(line) for line in Path(args.from_log).read_text().splitlines() if line.startswith("{")]
        if args.extra_log:
            runs += [{**json.loads(line), "excluded_from_summary": True}
                     for line in Path(args.extra_log).read_text().splitlines() if line.startswith("{")]
        write_results(runs, plan, {**meta, "rebuilt_from_log": True, "load_avg_at_start": None}, args.out)
        return
    runs: list[dict] = []
    t_start = time.monotonic()
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        for trial in range(args.trials):
            for system, conf in plan:
                for kind in kinds:
                    work = Path(tmp) / f"{system}-{conf}-{kind}-{trial}"
                    res: dict[str, dict] = {}
                    try:
                        jobs[kind](res, system, conf, work, etcd.endpoint, args.hang_wait, args.timeout,
                                   args.fault_offset)
                    except AssertionError as e:
                        res[f"{kind}_job_error"] = {"recovered": False, "note": str(e)}
                    for fault, r in res.items():
                        entry = {"system": system, "conf": conf, "trial": trial, "fault": fault,
                                 "load_avg_1m": round(os.getloadavg()[0], 1), **r}
                        runs.append(entry)
                        print(json.dumps(entry), flush=True)  # noqa: T201 - progress of a benchmark script
    write_results(runs, plan, {**meta, "wall_s": round(time.monotonic() - t_start, 1),
                               "load_avg_at_end": os.getloadavg()}, args.out)


if __name__ == "__main__":
    main()
