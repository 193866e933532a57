"""The worker's host allocator: glibc malloc as it is vs kept for reuse (`elastic.worker_malloc`), same run.

    python benchmarks/allocator.py [--sizes tiny,50m,150m] [--rounds 3] [--steps 8] [--world 2] [--out PATH]

What `elastictrain/runtime/allocator.py` changes, measured on the workload of scale.py: per size and round, two
fresh jobs of `--world` ranks (one process each, FSDP2 on gloo over loopback, scale.py's Llama of that size built
by the recipe's own functions, seq 16, a micro-batch of 4 sequences per rank, the recipe's AdamW and schedule,
`zero_grad()` freeing the gradients every step as torch does by default) train `--steps` steps after 2 warm-up
steps: one with glibc's defaults (`ELASTICTRAIN_WORKER_MALLOC=default`), one with `tune_malloc()` called at the
worker's start, as our workers do. Which goes first alternates per round. Each job reports its median step time
(rank 0's, each step ending in a barrier), the re-build a re-form in place pays (the model and optimizer dropped,
built again on the same mesh, filled and Adam's state allocated: `prepare_for_load`), and each rank's resident
memory at the end and at its peak. Per size: the ratio tuned / default of each round, and their medians.

Writes benchmarks/results/allocator.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastictrain.testing.ranks import run_worker_script, worker_entry

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results" / "allocator.json"
SEQ, MICRO = 16, 4
WARMUP = 2


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(rank: int, world: int, port: int, args: dict[str, Any]) -> dict[str, Any]:
    from elastictrain.runtime.allocator import tune_malloc

    applied = tune_malloc()  # as warmstart does for an agent's worker; `default` in the env leaves glibc alone
    import torch
    import torch.distributed as dist
    from scale import SIZES
    from torch.distributed.device_mesh import init_device_mesh

    from elastictrain.config import ModelConfig, OptimConfig, TrainConfig
    from elastictrain.recipes.model import build_optimizer, build_sharded, fill_weights
    from elastictrain.runtime.train_state import prepare_for_load

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    cfg = ModelConfig(name="llama", overrides={**SIZES[args["size"]], "vocab_size": 256,
                                               "max_position_embeddings": 512})
    train = TrainConfig(precision="fp32")

    def build() -> tuple[Any, Any, Any]:
        model = build_sharded(cfg, mesh, train, torch.device("cpu"))
        fill_weights(model, cfg, seed=0)
        optim, sched = build_optimizer(model, OptimConfig(), total_steps=1000)
        return model, optim, sched

    model, optim, sched = build()
    times = []
    for step in range(WARMUP + args["steps"]):
        started = time.perf_counter()
        tokens = torch.randint(0, 256, (MICRO, SEQ), generator=torch.Generator().manual_seed(step * world + rank))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad()
        dist.barrier()
        if step >= WARMUP:
            times.append(time.perf_counter() - started)
    rss_trained = _rss_bytes()
    dist.barrier()
    started = time.perf_counter()
    model = optim = sched = None  # a re-form: the old shards go before the new ones are allocated
    gc.collect()  # FSDP's modules hold their parameters in reference cycles (as the step loop's rebuild does)
    model, optim, sched = build()
    prepare_for_load(model, optim)
    dist.barrier()
    rebuild_s = time.perf_counter() - started
    out = {"applied": applied, "step_s": statistics.median(times), "steps_s": [round(t, 4) for t in times],
           "rebuild_s": rebuild_s, "rss_trained": rss_trained, "rss_end": _rss_bytes(),
           "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    dist.destroy_process_group()
    return out


def run_job(size: str, mode: str, world: int, steps: int, timeout: float) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix=f"allocator-{size}-{mode}-"))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "ELASTICTRAIN_WORKER_MALLOC": mode}
    try:
        return run_worker_script(__file__, work, world, {"size": size, "steps": steps}, timeout, env=env, cwd=REPO)
    except RuntimeError as e:
        raise RuntimeError(f"{size} {mode}: {e}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(size: str, rounds: int, world: int, steps: int, timeout: float) -> dict[str, Any]:
    trials = []
    for rnd in range(rounds):
        order = ("default", "tuned") if rnd % 2 == 0 else ("tuned", "default")
        jobs = {mode: run_job(size, mode, world, steps, timeout) for mode in order}
        trial = {"first": order[0]}
        for mode, ranks in jobs.items():
            trial[mode] = {"step_s": round(ranks[0]["step_s"], 4), "rebuild_s": round(ranks[0]["rebuild_s"], 3),
                           "rss_trained_mb": [round(r["rss_trained"] / 2**20) for r in ranks],
                           "rss_end_mb": [round(r["rss_end"] / 2**20) for r in ranks],
                           "rss_peak_mb": [round(r["rss_peak"] / 2**20) for r in ranks],
                           "applied": ranks[0]["applied"]}
        trial["step_ratio"] = round(trial["tuned"]["step_s"] / trial["default"]["step_s"], 3)
        trial["rebuild_ratio"] = round(trial["tuned"]["rebuild_s"] / trial["default"]["rebuild_s"], 3)
        print(f"{size} round {rnd}: step {trial['default']['step_s']:.3f} s default, {trial['tuned']['step_s']:.3f} s "
              f"tuned ({trial['step_ratio']}x); rebuild {trial['default']['rebuild_s']:.2f} / "
              f"{trial['tuned']['rebuild_s']:.2f} s; RSS at the end {trial['default']['rss_end_mb']} / "
              f"{trial['tuned']['rss_end_mb']} MB", flush=True)  # noqa: T201 - progress of a benchmark run
        trials.append(trial)

    def med(mode: str, key: str) -> float:
        return round(statistics.median(t[mode][key] for t in trials), 4)

    return {"size": size, "trials": trials, "median": {
        "step_s_default": med("default", "step_s"), "step_s_tuned": med("tuned", "step_s"),
        "step_ratio": round(statistics.median(t["step_ratio"] for t in trials), 3),
        "rebuild_s_default": med("default", "rebuild_s"), "rebuild_s_tuned": med("tuned", "rebuild_s"),
        "rebuild_ratio": round(statistics.median(t["rebuild_ratio"] for t in trials), 3)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,50m,150m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--note", default="")
    a = p.parse_args()
    started = time.time()
    load_before = os.getloadavg()
    sizes = [measure(s, a.rounds, a.world, a.steps, a.timeout) for s in a.sizes.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    doc = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)), "commit": commit.strip(),
                    "argv": sys.argv[1:], "note": a.note, "cpus": os.cpu_count(), "platform": platform.platform(),
                    "libc": platform.libc_ver(), "load_before": load_before, "load_after": os.getloadavg(),
                    "wall_s": round(time.time() - started, 1),
                    "metric": "step_s: rank 0's median step time (each step ends in a barrier) over --steps steps "
                              "after 2 warm-up steps; rebuild_s: dropping the model and optimizer and building "
                              "them again, filled, Adam's state allocated (a re-form in place); ratios tuned / "
                              "default per round, medians over rounds; rss_*: each rank's resident memory"},
           "sizes": sizes}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")  # noqa: T201


if __name__ == "__main__" and not worker_entry(_worker):
    main()
