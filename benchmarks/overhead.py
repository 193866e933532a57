"""Runtime overhead: the recipe's training step vs a minimal hand-written FSDP2 loop, same model, same run.

    python benchmarks/overhead.py [--nproc 2] [--rounds 7] [--steps-per-round 15]

Both loops live in the same worker processes and alternate in rounds (so machine noise hits both alike);
each reports the median step time per round, and the ratio of the medians is written to
benchmarks/results/overhead.json. Target: recipe / minimal <= 1.03.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = ["model.overrides.hidden_size=256", "model.overrides.intermediate_size=688",
         "model.overrides.num_hidden_layers=4", "model.overrides.num_attention_heads=4",
         "model.overrides.num_key_value_heads=4", "data.source=synthetic", "data.path=null", "data.seq_len=128",
         "data.global_batch_size=16", "data.micro_batch_size=4", "checkpoint.url=null", "checkpoint.every_steps=0",
         "train.progress=false", "logging.level=WARNING"]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from elastictrain.config import load_config
    from elastictrain.recipes.lm import Trainer
    from elastictrain.recipes.model import build_model, build_optimizer, shard_model
    from elastictrain.runtime.data import SyntheticSource
    from elastictrain.runtime.session import Session

    cfg = load_config(HERE.parent / "configs/tiny-cpu.yaml", [*MODEL, f"train.steps={10**6}"])
    session = Session(cfg.train).start()
    trainer = Trainer(cfg, session)

    # The minimal loop: what a user writes by hand around fully_shard, on the same model and data.
    d = cfg.data
    model = shard_model(build_model(cfg.model, cfg.train.seed), session.mesh, cfg.train, session.device)
    opt, sched = build_optimizer(model, cfg.optim, cfg.train.steps)
    src = SyntheticSource(d.synthetic_samples, d.seq_len, int(model.config.vocab_size), cfg.train.seed)
    W, rank = session.world_size, session.rank
    per_rank = d.global_batch_size // W
    accum = per_rank // d.micro_batch_size
    state = {"step": 0}

    def minimal_step() -> None:
        base = state["step"] * d.global_batch_size + rank * per_rank
        for i in range(accum):
            model.set_requires_gradient_sync(i == accum - 1)
            tokens = src.batch(range(base + i * d.micro_batch_size, base + (i + 1) * d.micro_batch_size))
            logits = model(input_ids=tokens[:, :-1]).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1

    def recipe_step() -> None:
        trainer.train_step().tolist()  # the recipe reads the reduced loss every step

    def measure(fn, n: int) -> float:
        times = []
        for _ in range(n):
            torch.distributed.barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    for fn in (minimal_step, recipe_step):  # warm-up both
        measure(fn, 3)
    rounds = []
    for r in range(args.rounds):
        order = (minimal_step, recipe_step) if r % 2 == 0 else (recipe_step, minimal_step)
        res = {fn.__name__: measure(fn, args.steps_per_round) for fn in order}
        rounds.append(res)
    if rank == 0:
        rec = statistics.median(x["recipe_step"] for x in rounds)
        mini = statistics.median(x["minimal_step"] for x in rounds)
        out = {
            "benchmark": "runtime overhead: recipe step vs minimal hand-written FSDP2 loop",
            "world_size": W, "params": sum(p.numel() for p in model.parameters()) * 1,
            "model": MODEL, "rounds": rounds, "steps_per_round": args.steps_per_round,
            "median_step_s": {"recipe": rec, "minimal": mini},
            "ratio_recipe_over_minimal": rec / mini, "target_ratio_max": 1.03,
            "torch": torch.__version__, "machine": f"{platform.machine()} {os.cpu_count()} cpus",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    session.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps-per-round", type=int, default=15)
    p.add_argument("--out", default=str(HERE / "results/overhead.json"))
    args = p.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           __file__, "--rounds", str(args.rounds), "--steps-per-round", str(args.steps_per_round), "--out", args.out]
    subprocess.run(cmd, env=env, check=True)
    res = json.loads(Path(args.out).read_text())
    sys.stdout.write(f"recipe/minimal step time ratio: {res['ratio_recipe_over_minimal']:.4f} "
                     f"(recipe {res['median_step_s']['recipe']*1e3:.1f} ms, "
                     f"minimal {res['median_step_s']['minimal']*1e3:.1f} ms) -> {args.out}\n")


if __name__ == "__main__":
    main()
