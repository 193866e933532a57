"""Rendezvous benchmark: node-loss recovery (etcd3 vs stock torchrun c10d) and rendezvous latency for N agents.

Writes benchmarks/results/rendezvous.json. Run: `python benchmarks/rendezvous.py [--runs 3]`.

Recovery: 3 torchrun agents x 1 gloo worker on localhost (worker step every 0.1 s); one node is
SIGKILLed (agent + worker, as a power loss); the figure is the time from the kill to the first step
the survivors complete in the re-formed 2-node group. For c10d the killed node is one that does *not*
host the TCPStore (killing that one ends the c10d job); for etcd3 both a non-rank-0 node and the
rank-0 ("first") node are measured, and for c10d the store host once (the job is expected to die:
"survived": false, no step within the timeout).

Latency: N lightweight agents (threads in one process, each with its own handler and etcd
connection) call `next_rendezvous()` at once with min = max = N; the figure is the time until the
last one has its rank.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastictrain.rendezvous.embedded import EmbeddedEtcd, find_etcd_binary, free_port  # noqa: E402
from tests.integration.rendezvous.launch import Agent, etcd3_args, start_agent, wait_for  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "rendezvous.json"

C10D_CONFS = {
    "defaults": "",
    # The tuning that gave 9.9 s in the design's measurement: short last call and heartbeats.
    "tuned": "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2",
}
ETCD3_CONFS = {
    "defaults": {"lease_ttl": 5, "last_call_timeout": 2},
    "tuned": {"lease_ttl": 2, "last_call_timeout": 1},
}


def _c10d_args(port: int, run_id: str, conf: str) -> list[str]:
    args = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}"]
    return [*args, f"--rdzv-conf={conf}"] if conf else args


def _store_host(agents: list[Agent], port: int) -> Agent | None:
    for agent in agents:
        try:
            conns = psutil.Process(agent.proc.pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
            return agent
    return None


def _victim_label(backend: str, kill_first: bool) -> str:
    if not kill_first:
        return "a node not hosting rank 0 (nor the c10d store)"
    return "the c10d store host (first node)" if backend == "c10d" else "rank-0 (first) node"


def recovery_once(backend: str, conf_name: str, kill_first: bool, endpoint: str | None, timeout: float) -> float:
    """One measurement: seconds from SIGKILL of a node to the survivors' next completed step."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # stock torchrun needs it to restart cleanly
    with tempfile.TemporaryDirectory(prefix="rdzv-bench-") as tmp:
        work = Path(tmp)
        port = free_port("127.0.0.1")
        if backend == "etcd3":
            assert endpoint is not None
            args = etcd3_args(endpoint, run_id, **ETCD3_CONFS[conf_name])
        else:
            args = _c10d_args(port, run_id, C10D_CONFS[conf_name])
        agents: list[Agent] = []
        try:
            for tag in ("a", "b", "c"):
                agents.append(start_agent(tag, work, args, nnodes="2:3", max_restarts=10, env=env))
                if backend == "c10d" and tag == "a":
                    time.sleep(1.0)  # let "a" bind the store port, as a real first node would
            steps = wait_for(work, lambda s: sum(x.world == 3 for x in s) >= 15, 120, agents)
            rank0 = next(s.tag for s in steps if s.world == 3 and s.rank == 0)
            if kill_first and backend == "c10d":
                # c10d's "first" node is the one hosting the TCPStore that everyone depends on.
                victim = _store_host(agents, port) or agents[0]
            elif kill_first:
                victim = next(a for a in agents if a.tag == rank0)
            else:
                spared = {rank0}
                if backend == "c10d":
                    host = _store_host(agents, port)
                    if host is not None:
                        spared.add(host.tag)
                victim = next(a for a in agents if a.tag not in spared)
            killed_at = victim.kill_node()
            agents.remove(victim)
            steps = wait_for(
                work, lambda s: any(x.world == 2 and x.time > killed_at for x in s), timeout, agents
            )
            return min(x.time for x in steps if x.world == 2 and x.time > killed_at) - killed_at
        finally:
            for agent in agents:
                agent.stop(timeout=10)


def latency_once(endpoint: str, n: int) -> dict[str, float]:
    """N threads rendezvous at once; return the time until the last has its rank, and the median."""
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from elastictrain.rendezvous.etcd_handler import create_etcd_handler

    run_id = f"lat-{uuid.uuid4().hex[:8]}"
    handlers = [create_etcd_handler(RendezvousParameters("etcd3", endpoint, run_id, n, n)) for _ in range(n)]
    durations: list[float] = [0.0] * n
    ranks: list[int] = [-1] * n
    gate = threading.Barrier(n)

    def agent(i: int) -> None:
        gate.wait()
        start = time.monotonic()
        ranks[i] = handlers[i].next_rendezvous().rank
        durations[i] = time.monotonic() - start

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for h in handlers:
        h.shutdown()
    assert sorted(ranks) == list(range(n)), ranks
    return {"n": n, "all_joined_s": round(max(durations), 3), "median_agent_s": round(statistics.median(durations), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="recovery runs per configuration")
    parser.add_argument("--latency-n", default="2,4,8,16,32")
    args = parser.parse_args()

    etcd_version = subprocess.run([find_etcd_binary(), "--version"], capture_output=True,
                                  text=True).stdout.split("\n")[0]
    result: dict[str, object] = {
        "meta": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "etcd": etcd_version,
            "python": platform.python_version(),
            "cpus": psutil.cpu_count(),
            "workload": "3 torchrun agents x 1 gloo worker on localhost, all_reduce step every 0.1 s",
            "metric": ("seconds from SIGKILL of one node (agent + worker) to the survivors' first step in the "
                       "2-node group"),
            "c10d_confs": C10D_CONFS,
            "etcd3_confs": ETCD3_CONFS,
        }
    }
    recovery: list[dict[str, object]] = []
    with EmbeddedEtcd() as etcd:
        plan = [
            ("c10d", "defaults", False, 1, 150.0),
            ("c10d", "tuned", False, args.runs, 90.0),
            ("etcd3", "defaults", False, args.runs, 90.0),
            ("etcd3", "tuned", False, args.runs, 90.0),
            ("etcd3", "tuned", True, args.runs, 90.0),
            ("etcd3", "defaults", True, 1, 90.0),
            ("c10d", "tuned", True, 1, 60.0),
        ]
        for backend, conf_name, kill_first, runs, timeout in plan:
            samples: list[float] = []
            failures: list[str] = []
            for _ in range(runs):
                try:
                    samples.append(round(recovery_once(backend, conf_name, kill_first, etcd.endpoint, timeout), 2))
                except AssertionError as exc:
                    failures.append(str(exc).splitlines()[0])
            entry = {
                "backend": backend,
                "conf": conf_name,
                "killed": _victim_label(backend, kill_first),
                "survived": bool(samples),
                "runs_s": samples,
                "median_s": round(statistics.median(samples), 2) if samples else None,
                "failures": failures,
            }
            recovery.append(entry)
            print(json.dumps(entry), flush=True)  # noqa: T201 - a benchmark script reports progress
        result["recovery"] = recovery
        latency = []
        for n in (int(x) for x in args.latency_n.split(",")):
            entry = latency_once(etcd.endpoint, n)
            latency.append(entry)
            print(json.dumps(entry), flush=True)  # noqa: T201
        result["rendezvous_latency"] = latency
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")  # noqa: T201


if __name__ == "__main__":
    main()
