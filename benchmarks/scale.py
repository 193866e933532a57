"""Scale benchmark: time lost per fault against train-state size, stock torchrun vs ours with and without snapshots.

Writes benchmarks/results/scale.json and scale.png. Run: `python benchmarks/scale.py [--sizes tiny,50m,150m]
[--trials 3] [--storage local,s3] [--faults worker,node]`; a smoke run: `--sizes tiny --trials 1 --storage local
--out /tmp/scale-smoke.json`.

Workload: the reference recipe (elastictrain.recipes.lm, Llama shapes of `SIZES`, synthetic data, seq 16, global
batch 8, one micro-batch of 4 per rank, FSDP2 on gloo) as 2 nodes x 1 worker on localhost, `--nnodes 1:2`, a
durable checkpoint every 5 steps on a local directory or on the S3 server (`rclone serve s3` on loopback), sample
ledger on: recovery.py's `Job` with these settings. Configurations, side by side: `stock` (torchrun, c10d, restarts
from the durable checkpoint), `ours-durable` (`elastictrain run`, etcd, durable tier only), `ours-snapshot` (the
same with checkpoint.snapshot_every_steps=1) and `ours-in-place` (snapshots and elastic.in_place: a killed worker is
replaced alone while its peers keep their processes and pause in place; a node kill takes the restart path), and
`ours-in-place-lease` (ours-in-place without the agents' presence links: a dead node is seen when its lease expires).
Launcher settings from recovery.py's CONFS: ours "tuned" (2 s leases,
1 s last call, 3 s hang floor), stock "defaults" (torch's keep-alives, so a node loss is seen after ~45 s; its
"tuned" settings split the job into two 1-node jobs under load here, and never admit a re-joining node), both
changeable with --ours-conf / --stock-conf. A worker kill is seen by both launchers' monitors (0.1 s) alike.

One job per trial, size, storage and configuration; the configurations take turns (their order rotates with the
trial). Each job, once 8 steps trained on 2 nodes and ours' spares are ready:

1. worker SIGKILL (node b's worker), fired when the group has completed exactly 3 steps past the newest committed
   checkpoint (fault_point.py); then 8 steps on 2 nodes again;
2. node SIGKILL (node b's agent and worker, its /dev/shm folder left to the next agent's sweep), at the same
   offset, and node b started again at once (`--rejoin-after`) with the same command, as the chaos tests do. Ours
   waits for it (`--rejoin-wait`, elastic.rejoin_wait_s: the chaos tests' WAIT_FOR_REJOIN), so the job goes on
   on 2 nodes and can resume from b's snapshots replicated on a; stock re-forms as torch does;
3. or `gone` (it can only come last): node b SIGKILLed for good, never started again. The survivor goes on alone:
   stock and ours restarting it in a new 1-node round (run it with `--rejoin-wait 0`, or ours waits that long for
   b), ours-in-place shrinking the running round to a world of 1 inside the survivor's process
   (elastic.in_place_shrink). Time lost counts until the survivor alone is one step past where the job was (its
   steps take longer: the global batch is all its own), minus one fault-free 2-node step; `recovery_s` is from the
   fault to the survivor's first completed step.
   For a `node` fault after which the survivor went on alone (`--rejoin-wait 0`), `on_two.rejoin_stall_s` is the
   stall when node b came back: from the survivor's last step alone to the first step on 2 nodes (ours in place:
   the survivors' pause of a grow; the other configurations: a scale-up restart).

Each fault fires half a fault-free step after the group completed its step (`--fault-at`: where a fault at a random
time lands on average; 0 is the worst case for the snapshot copy, which overlaps the next step). Time lost by a
fault: from the end of that step until the job is one step past where it was (a group launched after the fault
completes a step beyond the furthest any earlier group completed), minus one fault-free step (the median
step-to-step time of the 2-node groups before it): detection + restart + load + recomputation. Where that step is
a survivor's alone (1 rank), `on_two` gives the same until a 2-node group is past where the job was. Steps
recomputed: steps an earlier group completed that the new one ran again; `tier`: whether the new group started
after the newest durable checkpoint (a snapshot or its replica) or from it. Snapshot cost: median fault-free
2-node step time of ours-snapshot over ours-durable, paired per trial (same size, storage, trial).
Every process is stopped by PID; checkpoints and the jobs' /dev/shm snapshot folders are removed after each job.
A job that did not start or ended in an error names the last ERROR line of each node's log; a job during which the
kernel OOM-killed a process (two simulated 150M nodes with replicas fill a 24 GB host) lists the kills (`oom_kills`,
from dmesg): such a kill looks like a fault to the job and is not one of ours.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fault_point import (  # noqa: E402
    arm_node_kill,
    arm_worker_signal,
    at_offset,
    committed_step,  # noqa: E402
)
from benchmarks.recovery import CONFS, Completed, Job, _spares_ready, _split, unwind_on_sigterm  # noqa: E402
from benchmarks.scale_results import plot, summarize  # noqa: E402
from elastictrain.checkpoint.manifest import step_dir_name  # noqa: E402
from elastictrain.rendezvous.embedded import EmbeddedEtcd  # noqa: E402
from elastictrain.testing.s3server import S3Server  # noqa: E402
from tests.chaos.cluster import Node  # noqa: E402
from tests.integration.recipe_runs import worker_env  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "scale.json"
CKPT_EVERY = 5
FAULT_OFFSET = 3
WARMUP_STEPS = 8
"""2-node steps before a fault: the hang detector calibrates on 5, and a checkpoint commits."""
_SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(zip(_SHAPE, (32, 64, 2, 2, 2))),  # the chaos tests' and recovery.py's model
    "50m": dict(zip(_SHAPE, (768, 2048, 7, 12, 12))),
    "150m": dict(zip(_SHAPE, (1024, 2816, 12, 16, 16))),
}
CONFIGS: dict[str, tuple[str, int | str]] = {  # name -> (launcher, checkpoint.snapshot_every_steps)
    "stock": ("stock", 0), "ours-durable": ("ours", 0), "ours-snapshot": ("ours", 1), "ours-in-place": ("ours", 1),
    "ours-auto": ("ours", "auto"),  # the interval measured (benchmarks/snapshot_pace.py)
    "ours-in-place-lease": ("ours", 1)}
IN_PLACE = {"ours-in-place", "ours-in-place-lease"}
"""Configurations with elastic.in_place: a killed worker is replaced alone, its peers pause in place (#15)."""
LEASE_ONLY = {"ours-in-place-lease"}
"""Configurations without the agents' presence links (elastic.presence_link=false): a lost node is seen when its etcd
lease expires, as before the links."""
DATA = ["data.seq_len=16", "data.global_batch_size=8", "data.micro_batch_size=4"]


def model_size(size: str) -> dict:
    """Parameters of the size's model (built on the meta device) and its train state: fp32 params + Adam's moments."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model("llama", vocab_size=256, max_position_embeddings=512, **SIZES[size])
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    return {"shape": SIZES[size], "params": params, "train_state_bytes": params * 4 * 3}


class ScaleJob(Job):
    """recovery.py's job at a model size, a storage and a configuration."""

    def __init__(self, config: str, size: str, work: Path, endpoint: Optional[str], s3: Optional[S3Server],
                 confs: dict[str, str], rejoin_wait: float):
        """`confs`: launcher -> recovery.py's CONFS entry ("tuned" or "defaults"); `rejoin_wait`: ours' survivors
        wait this long for a lost node to come back before they re-form without it."""
        launcher, self.snapshot_every = CONFIGS[config]
        self.config, self.in_place = config, config in IN_PLACE
        super().__init__(launcher, confs[launcher], work, endpoint)
        self.rejoin_wait = rejoin_wait
        self.run_id = f"scale-{uuid.uuid4().hex[:8]}"
        self.size, self.s3 = size, s3
        if s3 is None:
            self.ckpt_url, self.ckpt_dir = str(self.out / "ckpt"), self.out / "ckpt"
        else:
            bucket = s3.make_bucket(f"scale-{uuid.uuid4().hex[:10]}")
            self.ckpt_url, self.ckpt_dir = f"s3://{bucket}/ckpt", Path(s3.root) / bucket / "ckpt"

    def command(self, name: str) -> list[str]:
        sets = [*(f"model.overrides.{k}={v}" for k, v in SIZES[self.size].items()), *DATA,
                f"checkpoint.url={self.ckpt_url}", f"checkpoint.every_steps={CKPT_EVERY}",
                f"checkpoint.snapshot_every_steps={self.snapshot_every}",
                *(["elastic.in_place=true"] if self.in_place else []),
                *(["elastic.presence_link=false"] if self.config in LEASE_ONLY else [])]
        cmd = super().command(name)
        at = len(cmd) - cmd[::-1].index("--set") + 1  # after recovery.py's last --set: later ones win
        cmd = cmd[:at] + [x for s in sets for x in ("--set", s)] + cmd[at:]
        return with_rejoin_wait(cmd, self.rejoin_wait) if self.system == "ours" else cmd

    def start(self, name: str) -> Node:
        env = {**worker_env(), **(self.s3.env() if self.s3 else {})}
        node = Node(name, self.command(name), env, self.out / f"{name}-{len(self.nodes)}.log")
        self.nodes.append(node)
        return node

    def node_b(self) -> Node:
        return next(n for n in reversed(self.nodes) if n.name == "b")

    def checkpoint_bytes(self) -> Optional[int]:
        """Bytes of the newest committed durable checkpoint (every rank's files, DCP metadata, manifest)."""
        step = committed_step(self.ckpt_dir)
        if step is None:
            return None
        return sum(f.stat().st_size for f in (self.ckpt_dir / step_dir_name(step)).rglob("*") if f.is_file())

    def clean(self) -> None:
        """Stop every process of the job, then remove its checkpoints and its agents' /dev/shm snapshot folders."""
        self.close()  # its agents' snapshot folders go with it (recovery.py's Job.close)
        shutil.rmtree(self.ckpt_dir.parent if self.s3 else self.ckpt_dir, ignore_errors=True)


# --- the timeline: pure functions of the completed steps -------------------------------------------------------

def step_time(done: list[Completed], skip: int = 2) -> Optional[float]:
    """Median seconds from one completed step to the next within a group, leaving out each group's first `skip`
    steps (the first steps fault pages in, and the first snapshot reserves its memory)."""
    gaps = []
    for seq in {c.seq for c in done}:
        cs = sorted((c for c in done if c.seq == seq), key=lambda c: c.step)
        gaps += [b.time - a.time for a, b in zip(cs, cs[1:]) if b.step == a.step + 1 and a.step >= cs[0].step + skip]
    return statistics.median(gaps) if gaps else None


def time_lost(done: list[Completed], old_seq: int, step_s: float, since: Optional[float] = None,
              world: Optional[int] = None) -> Optional[dict]:
    """What interrupting the group `old_seq` cost, once a newer group (of `world` ranks) is one step past.

    `since`: when progress stopped (the fault); None: the last step an earlier group completed before the newer
    group's first (a re-join, during whose start the old group trains on). None while no newer group got past the
    furthest step any earlier group completed.
    """
    new = sorted((c for c in done if c.seq > old_seq and (world is None or c.world == world)), key=lambda c: c.time)
    if not new:
        return None
    first = new[0]
    old = [c for c in done if c.seq < first.seq]
    reached = max(c.step for c in old)
    past = next((c for c in new if c.step > reached), None)
    if past is None:
        return None
    start = since if since is not None else max((c.time for c in old if c.time <= first.time), default=first.time)
    resumed_at = min(c.step for c in new if c.seq == first.seq)
    return {"recovery_s": round(first.time - start, 3), "past_s": round(past.time - start, 3),
            "time_lost_s": round(past.time - start - step_s, 3), "steps_recomputed": max(0, reached + 1 - resumed_at),
            "resumed_at_step": resumed_at, "reached_step": reached, "world": past.world}


# --- one job ----------------------------------------------------------------------------------------------------

def wait_steps(job: ScaleJob, after_seq: int, steps: int, world: int, timeout: float) -> bool:
    """Wait until a group launched after `after_seq` on `world` ranks completed `steps` steps; fails on a split."""
    def pred(c: Completed) -> bool:
        return c.seq > after_seq and c.world == world and c.step - job.watch.first[c.seq] + 1 >= steps
    found = job.watch.wait(pred, timeout, job.nodes, abort=lambda: _split(job))
    assert not _split(job), "split brain: two 1-node groups trained at the same time"
    return found is not None


def wait_past(job: ScaleJob, old_seq: int, step_s: float, timeout: float, since: Optional[float] = None,
              world: Optional[int] = None) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(n.alive() for n in job.nodes):
        res = time_lost(job.watch.snapshot(), old_seq, step_s, since, world)
        if res is not None:
            return {"recovered": True, **res}
        time.sleep(0.05)
    return {"recovered": False, "note": f"no group got one step past within {timeout:.0f} s"}


def with_rejoin_wait(cmd: list[str], wait: float) -> list[str]:
    """Our agent's command with `wait` s of a re-forming round's last call kept for a lost node (the chaos tests'
    WAIT_FOR_REJOIN); `--rdzv-conf` keys win over the config, and the wait is at most the last call."""
    if wait <= 0:
        return cmd
    conf = dict(kv.split("=", 1) for kv in cmd[cmd.index("--rdzv-conf") + 1].split(",")) if "--rdzv-conf" in cmd else {}
    conf["last_call_timeout"] = f"{max(float(conf.get('last_call_timeout', 0)), wait):g}"
    conf["rejoin_wait"] = f"{wait:g}"
    value = ",".join(f"{k}={v}" for k, v in conf.items())
    if "--rdzv-conf" in cmd:
        i = cmd.index("--rdzv-conf") + 1
        return [*cmd[:i], value, *cmd[i + 1:]]
    return [*cmd, "--rdzv-conf", value]


def fault(job: ScaleJob, kind: str, bound: float, rejoin_after: float, at: float = 0.5) -> dict:
    """SIGKILL node b's worker ("worker"), or node b then start it again `rejoin_after` s later with the same
    command ("node"), `at` of a fault-free step after the group completed its 3rd step past a committed checkpoint;
    what it cost. Time lost counts from that step's end: an uninterrupted job would have finished the next step one
    fault-free step later."""
    b = job.node_b()
    fire = arm_worker_signal(b.pid, signal.SIGKILL) if kind == "worker" else arm_node_kill(b.pid)
    gone = kind == "gone"
    alive: Callable[[], bool] = lambda: any(n.alive() for n in job.nodes)  # noqa: E731
    before, where = at_offset(job.watch, job.ckpt_dir, FAULT_OFFSET, alive, timeout=bound)
    step_s = step_time([c for c in job.watch.snapshot() if c.world == 2])
    t = time.monotonic()
    time.sleep(at * step_s)
    fire()
    fired = time.monotonic()
    if kind in ("node", "gone"):
        b.kill()  # reaps it, and whatever started after the look-up
    if kind == "node":
        time.sleep(max(0.0, fired + rejoin_after - time.monotonic()))
        job.start("b")
    out = {**where, "step_s": round(step_s, 3),
           **wait_past(job, before.seq, step_s, bound, since=t, world=1 if gone else None)}
    if out["recovered"]:
        out["tier"] = "snapshot" if out["resumed_at_step"] > where["ckpt_step"] else "durable"
        if out["world"] != 2 and not gone:  # the survivor went on alone: also when the job is past it on 2 nodes again
            on_two = wait_past(job, before.seq, step_s, bound, since=t, world=2)
            out["on_two"] = {k: on_two.get(k) for k in ("recovered", "past_s", "time_lost_s", "steps_recomputed")}
            out["on_two"]["rejoin_stall_s"] = rejoin_stall(job.watch.snapshot(), t)
    out["before_seq"] = before.seq
    return out


def rejoin_stall(done: list, since: float) -> Optional[float]:
    """When the survivor went on alone and node b came back: the seconds without a completed step as the job became
    2 nodes again, from the survivor's last step alone to the first step on 2 nodes (one step's compute included).
    Ours in place: the survivor's pause to re-form with the new node (a grow); a restart path: the scale-up."""
    done = sorted((c for c in done if c.time > since), key=lambda c: c.time)
    alone = next((i for i, c in enumerate(done) if c.world == 1), None)
    if alone is None:
        return None
    first_two = next((i for i in range(alone, len(done)) if done[i].world == 2), None)
    if first_two is None:
        return None
    return round(done[first_two].time - done[first_two - 1].time, 3)


_OOM_KILL = re.compile(r"^\[\s*(\d+\.\d+)\] Out of memory: Killed process (\d+) \(([^)]*)\)"
                       r".*?anon-rss:(\d+)kB.*?shmem-rss:(\d+)kB", re.M)


def oom_kills(since_boot_s: float) -> list[dict]:
    """The kernel's OOM kills since `since_boot_s` (seconds since boot, CLOCK_BOOTTIME), from dmesg: a process
    killed for memory looks like an injected fault to the job, and is not one. [] where dmesg cannot be read."""
    try:
        text = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [{"at_boot_s": float(m[1]), "pid": int(m[2]), "name": m[3], "anon_rss_mb": int(m[4]) // 1024,
             "shmem_rss_mb": int(m[5]) // 1024} for m in _OOM_KILL.finditer(text) if float(m[1]) >= since_boot_s]


def _last_errors(job: "ScaleJob") -> str:
    """The last ERROR line of each node's log (why a job did not start, or ended)."""
    found = []
    for n in job.nodes:
        lines = [line for line in n.log().splitlines() if " ERROR " in line]
        if lines:
            found.append(f"{n.name}: {lines[-1][-400:]}")
    return "; ".join(found)


def run_job(config: str, size: str, work: Path, endpoint: str, s3: Optional[S3Server], args) -> dict:
    """Start the job (again, if it split into two 1-node jobs), then the faults of `args.faults` in turn."""
    out: dict = {"failed_starts": []}
    booted = time.clock_gettime(time.CLOCK_BOOTTIME)
    try:
        return _run_job(config, size, work, endpoint, s3, args, out)
    finally:
        kills = oom_kills(booted)
        if kills:
            out["oom_kills"] = kills
            print(f"the kernel killed {len(kills)} process(es) for memory during this job: {kills}",  # noqa: T201
                  file=sys.stderr, flush=True)


def _run_job(config: str, size: str, work: Path, endpoint: str, s3: Optional[S3Server], args, out: dict) -> dict:
    for attempt in range(args.start_attempts):
        ours = CONFIGS[config][0] == "ours"
        job = ScaleJob(config, size, work / f"start-{attempt}", endpoint if ours else None, s3, args.confs,
                       args.rejoin_wait)
        try:
            job.start_both()
            if wait_steps(job, -1, WARMUP_STEPS, 2, args.start_timeout):
                break
            why = _last_errors(job)
            out["failed_starts"].append(f"not {WARMUP_STEPS} steps on 2 nodes within {args.start_timeout:.0f} s"
                                        + (f" ({why})" if why else ""))
        except AssertionError as e:
            out["failed_starts"].append(str(e))
        except BaseException:
            job.clean()
            raise
        job.clean()
    else:
        out["error"] = "did not start"
        return out
    try:
        out["startup_s"] = round(job.watch.snapshot()[0].time - job.nodes[0].started, 2)
        for kind in args.faults:
            _spares_ready(job)
            bound = args.timeout + 20 * (step_time([c for c in job.watch.snapshot() if c.world == 2]) or 0)
            res = out[f"{kind}_kill"] = fault(job, kind, bound, args.rejoin_after, args.fault_at)
            print(json.dumps({"config": config, "size": size, "fault": kind, **res}), flush=True)  # noqa: T201
            if not res["recovered"]:
                break
            if kind != args.faults[-1]:
                assert kind != "gone", "--faults: gone must come last (node b never comes back)"
                assert wait_steps(job, res["before_seq"], WARMUP_STEPS, 2, bound), "no 2-node group after the fault"
        # fault-free: the 2-node groups up to the last fault
        upto = max((out[f"{k}_kill"]["before_seq"] for k in args.faults if f"{k}_kill" in out), default=None)
        step_s = step_time([c for c in job.watch.snapshot() if c.world == 2 and (upto is None or c.seq <= upto)])
        out["step_s"] = None if step_s is None else round(step_s, 4)
        out["checkpoint_bytes"] = job.checkpoint_bytes()
    except Exception as e:  # one job's failure is its entry: an unattended run of hours goes on
        why = _last_errors(job)
        out["error"] = f"{type(e).__name__}: {e}" + (f" ({why})" if why else "")
    finally:
        job.clean()
    return out


def _git() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        dirty = git("status", "--porcelain", "--", "benchmarks/*.py", "elastictrain")
        return git("rev-parse", "HEAD") + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"platform": platform.platform(), "cpu": cpu, "cpus": psutil.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total, "dev_shm_bytes": shutil.disk_usage("/dev/shm").total,
            "python": platform.python_version(), "torch": torch.__version__}


def main() -> None:
    unwind_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,50m,150m", help=f"model sizes, of {','.join(SIZES)} (default %(default)s)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--storage", default="local,s3", help="durable tier: local and/or s3 (default %(default)s)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="default %(default)s")
    p.add_argument("--faults", default="worker,node", help="in each job, in this order (default %(default)s)")
    p.add_argument("--rejoin-after", type=float, default=0.0, help="seconds from a node kill to its restart")
    p.add_argument("--fault-at", type=float, default=0.5,
                   help="fire this fraction of a step after a step completed (default %(default)s, the expected point "
                        "of a fault at a random time; 0: right after, the worst case for the overlapped snapshot copy)")
    p.add_argument("--rejoin-wait", type=float, default=60.0,
                   help="ours: seconds a re-forming group waits for a lost node to come back (elastic.rejoin_wait_s, "
                        "as the chaos tests' WAIT_FOR_REJOIN; 0: the survivor goes on alone) (default %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0, help="bound on a recovery, plus 20 fault-free steps")
    p.add_argument("--start-timeout", type=float, default=600.0, help=f"bound on {WARMUP_STEPS} steps after a start")
    p.add_argument("--start-attempts", type=int, default=5, help="starts tried when a job splits into two")
    p.add_argument("--ours-conf", default="tuned", choices=("tuned", "defaults"),
                   help="our agent's settings, of recovery.py's CONFS (default %(default)s)")
    p.add_argument("--stock-conf", default="defaults", choices=("tuned", "defaults"),
                   help="stock torchrun's settings, of recovery.py's CONFS; tuned splits into two 1-node jobs under "
                        "load and never admits a re-joining node (default %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS, help="the JSON; the PNG goes beside it (default %(default)s)")
    p.add_argument("--keep", type=Path, help="keep the jobs' logs and ledgers under this directory")
    p.add_argument("--note", default="", help="free text kept in meta.note (a smoke run, what else ran)")
    p.add_argument("--plot-only", action="store_true", help="recompute the summary and redraw the PNG from --out")
    args = p.parse_args()
    if args.plot_only:
        result = json.loads(args.out.read_text())
        result.update(summarize(result["runs"], result["meta"]["sizes"]))
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, args.out.with_suffix(".png"))
        return
    sizes, storages, configs = args.sizes.split(","), args.storage.split(","), args.configs.split(",")
    args.faults = args.faults.split(",")
    args.confs = {"ours": args.ours_conf, "stock": args.stock_conf}
    for bad, allowed, what in ((sizes, SIZES, "--sizes"), (storages, ("local", "s3"), "--storage"),
                               (configs, CONFIGS, "--configs"), (args.faults, ("worker", "node", "gone"), "--faults")):
        if not set(bad) <= set(allowed):
            p.error(f"{what}: choose from {','.join(allowed)}")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", "benchmarks/scale.py", *sys.argv[1:]]), "git": _git(),
            "machine": machine(), "note": args.note, "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
            "sizes": {s: model_size(s) for s in sizes},
            "settings": {"trials": args.trials, "storage": storages, "configs": configs, "faults": args.faults,
                         "rejoin_after_s": args.rejoin_after, "ours_rejoin_wait_s": args.rejoin_wait,
                         "checkpoint_every_steps": CKPT_EVERY, "fault_offset": FAULT_OFFSET,
                         "fault_at_step_fraction": args.fault_at,
                         "warmup_steps": WARMUP_STEPS, "data": DATA,
                         "launcher_conf": {"ours": args.ours_conf, "stock": args.stock_conf, "confs": CONFS},
                         "timeout_s": args.timeout}}
    runs: list[dict] = []
    t_start = time.monotonic()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    keep = Path(tempfile.mkdtemp(prefix="scale-bench-", dir=args.keep)) if args.keep else None
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory(prefix="scale-bench-") as tmp, \
            S3Server() if "s3" in storages else nullcontext() as s3:
        for trial in range(args.trials):
            order = configs[trial % len(configs):] + configs[:trial % len(configs)]
            for size in sizes:
                for storage in storages:
                    for config in order:
                        work = Path(keep or tmp) / f"{size}-{storage}-{config}-{trial}"
                        load = round(os.getloadavg()[0], 2)
                        res = run_job(config, size, work, etcd.endpoint, s3 if storage == "s3" else None, args)
                        entry = {"config": config, "size": size, "storage": storage, "trial": trial,
                                 "load_avg_1m": [load, round(os.getloadavg()[0], 2)], **res}
                        runs.append(entry)
                        print(json.dumps(entry), flush=True)  # noqa: T201 - progress of a benchmark script
                        write(args.out, meta, runs, t_start, complete=False)  # hours of runs: keep what is done
    result = write(args.out, meta, runs, t_start, complete=True)
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out}", flush=True)  # noqa: T201


def write(out: Path, meta: dict, runs: list[dict], t_start: float, complete: bool) -> dict:
    meta.update(complete=complete, wall_s=round(time.monotonic() - t_start, 1),
                load_avg_at_end=[round(x, 2) for x in os.getloadavg()])
    result = {"meta": meta, **summarize(runs, meta["sizes"]), "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
