"""The worker's host allocator: glibc malloc as it is vs kept for reuse (`elastic.worker_malloc`), or without vs
with huge pages (`elastic.worker_huge_pages`), same run.

    python benchmarks/allocator.py [--sizes tiny,50m,150m] [--rounds 3] [--steps 8] [--world 2] [--out PATH]
                                   [--modes default,tuned | tuned,tuned+thp]

What `elastictrain/runtime/allocator.py` changes, measured on the workload of scale.py: per size and round, two
fresh jobs of `--world` ranks (one process each, FSDP2 on gloo over loopback, scale.py's Llama of that size built
by the recipe's own functions, seq 16, a micro-batch of 4 sequences per rank, the recipe's AdamW and schedule,
`zero_grad()` freeing the gradients every step as torch does by default) train `--steps` steps after 2 warm-up
steps: one with glibc's defaults (`ELASTICTRAIN_WORKER_MALLOC=default`), one with `tune_malloc()` called at the
worker's start, as our workers do. Which goes first alternates per round. Each job reports its median step time
(rank 0's, each step ending in a barrier), the re-build a re-form in place pays (the model and optimizer dropped,
built again on the same mesh, filled and Adam's state allocated: `prepare_for_load`), what a smaller world's
re-form pays to allocate its bigger shards (each rank builds the whole state on a mesh of itself alone, every page
touched as the load would: `shrink_s`), and each rank's resident memory at the end and at its peak. Per size: the
ratio of the second mode to the first of each round, and their medians. `--modes tuned,tuned+thp` compares
`elastic.worker_huge_pages` off and on (torch's THP_MEM_ALLOC_ENABLE).

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

from elastictrain.runtime.allocator import ENV_TORCH_THP
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
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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

    def build(fill: bool = True) -> tuple[Any, Any, Any]:
        model = build_sharded(cfg, mesh, train, torch.device("cpu"))
        if fill:
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
    # A smaller world in place: each rank's shard grows (here to the whole state, a mesh of this rank alone), and the
    # allocation of the bigger state, every page a first touch, is most of what the re-form spends before its load.
    alone = DeviceMesh.from_group(dist.new_group([rank]) if world > 1 else dist.group.WORLD, "cpu")
    dist.barrier()
    started = time.perf_counter()
    model = optim = sched = None
    gc.collect()
    mesh = alone
    model, optim, sched = build(fill=False)  # a load fills it: `prepare_for_load` touches every page, as the load would
    prepare_for_load(model, optim)
    shrink_s = time.perf_counter() - started
    dist.barrier()
    out = {"applied": applied, "step_s": statistics.median(times), "steps_s": [round(t, 4) for t in times],
           "rebuild_s": rebuild_s, "shrink_s": shrink_s, "rss_trained": rss_trained, "rss_end": _rss_bytes(),
           "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    dist.destroy_process_group()
    return out


def mode_env(mode: str) -> dict[str, str]:
    """A mode's worker environment: `default` or `tuned` (`elastic.worker_malloc`), `+thp` for
    `elastic.worker_huge_pages` (torch's THP_MEM_ALLOC_ENABLE; without it, the switch is off)."""
    malloc, _, extra = mode.partition("+")
    if malloc not in ("default", "tuned") or extra not in ("", "thp"):
        raise SystemExit(f"--modes: {mode!r} is not one of default, tuned, default+thp, tuned+thp")
    return {"ELASTICTRAIN_WORKER_MALLOC": malloc, ENV_TORCH_THP: "1" if extra else "0"}


def run_job(size: str, mode: str, world: int, steps: int, timeout: float) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix=f"allocator-{size}-{mode}-"))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **mode_env(mode)}
    try:
        return run_worker_script(__file__, work, world, {"size": size, "steps": steps}, timeout, env=env, cwd=REPO)
    except RuntimeError as e:
        raise RuntimeError(f"{size} {mode}: {e}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(size: str, rounds: int, world: int, steps: int, timeout: float,
            modes: tuple[str, str] = ("default", "tuned")) -> dict[str, Any]:
    base, new = modes
    trials = []
    for rnd in range(rounds):
        order = (base, new) if rnd % 2 == 0 else (new, base)
        jobs = {mode: run_job(size, mode, world, steps, timeout) for mode in order}
        trial = {"first": order[0]}
        for mode, ranks in jobs.items():
            trial[mode] = {"step_s": round(ranks[0]["step_s"], 4), "rebuild_s": round(ranks[0]["rebuild_s"], 3),
                           "shrink_s": round(max(r["shrink_s"] for r in ranks), 3),
                           "rss_trained_mb": [round(r["rss_trained"] / 2**20) for r in ranks],
                           "rss_end_mb": [round(r["rss_end"] / 2**20) for r in ranks],
                           "rss_peak_mb": [round(r["rss_peak"] / 2**20) for r in ranks],
                           "applied": ranks[0]["applied"]}
        for key in ("step", "rebuild", "shrink"):
            trial[f"{key}_ratio"] = round(trial[new][f"{key}_s"] / trial[base][f"{key}_s"], 3)
        print(f"{size} round {rnd}: step {trial[base]['step_s']:.3f} s {base}, {trial[new]['step_s']:.3f} s "
              f"{new} ({trial['step_ratio']}x); rebuild {trial[base]['rebuild_s']:.2f} / "
              f"{trial[new]['rebuild_s']:.2f} s; shrink {trial[base]['shrink_s']:.2f} / "
              f"{trial[new]['shrink_s']:.2f} s; RSS at the end {trial[base]['rss_end_mb']} / "
              f"{trial[new]['rss_end_mb']} MB",
              flush=True)  # noqa: T201 - progress of a benchmark run
        trials.append(trial)

    def med(mode: str, key: str) -> float:
        return round(statistics.median(t[mode][key] for t in trials), 4)

    return {"size": size, "modes": [base, new], "trials": trials, "median": {
        **{f"{key}_s_{mode}": med(mode, f"{key}_s") for key in ("step", "rebuild", "shrink") for mode in modes},
        **{f"{key}_ratio": round(statistics.median(t[f"{key}_ratio"] for t in trials), 3)
           for key in ("step", "rebuild", "shrink")}}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,50m,150m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--modes", default="default,tuned",
                   help="the two modes compared, each default or tuned (elastic.worker_malloc), +thp for "
                        "elastic.worker_huge_pages; ratios second / first")
    p.add_argument("--note", default="")
    a = p.parse_args()
    modes = tuple(a.modes.split(","))
    if len(modes) != 2:
        raise SystemExit("--modes takes two modes, e.g. tuned,tuned+thp")
    for mode in modes:
        mode_env(mode)
    started = time.time()
    load_before = os.getloadavg()
    sizes = [measure(s, a.rounds, a.world, a.steps, a.timeout, modes) for s in a.sizes.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    doc = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)), "commit": commit.strip(),
                    "argv": sys.argv[1:], "note": a.note, "cpus": os.cpu_count(), "platform": platform.platform(),
                    "libc": platform.libc_ver(), "load_before": load_before, "load_after": os.getloadavg(),
                    "wall_s": round(time.time() - started, 1),
                    "metric": "step_s: rank 0's median step time (each step ends in a barrier) over --steps steps "
                              "after 2 warm-up steps; rebuild_s: dropping the model and optimizer and building "
                              "them again, filled, Adam's state allocated (a re-form in place); shrink_s: the "
                              "slower rank's drop and build of the whole state on a mesh of itself alone, every page "
                              "touched (a smaller world's allocation); ratios second mode / first per round, medians "
                              "over rounds; rss_*: each rank's resident memory"},
           "sizes": sizes}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")  # noqa: T201


if __name__ == "__main__" and not worker_entry(_worker):
    main()
