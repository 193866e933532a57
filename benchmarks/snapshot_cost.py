"""What an in-memory snapshot every step costs the step: training with checkpoint.snapshot_every_steps=1 vs 0, same run.

    python benchmarks/snapshot_cost.py [--sizes tiny,50m,150m] [--rounds 5] [--steps 4] [--out PATH]

One process (no process group: the copy is per rank, so one rank shows its cost), a transformers Llama of each size
with AdamW on random tokens, the public API's `StateCheckpointer` with a snapshot folder on /dev/shm, as under our
agent. Each round runs `--steps` steps with a snapshot after every step and `--steps` steps without, in alternating
order; the first step of each block is not timed (it carries the previous block's copy). A round gives the median
step time of each block; the figure per size is the median over rounds of the ratio on/off (target <= 1.05: the copy
of the optimizer's parameters and state overlaps the next step, the rest is copied in the step). The same ratio of
process CPU time shows the copy's work, which a 2-core CPU machine cannot hide behind a step that uses both cores.

Writes benchmarks/results/snapshot_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
TARGET_RATIO = 1.05
SIZES: dict[str, dict[str, int]] = {
    # hidden, layers, intermediate, vocab, seq_len, batch
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=256, seq=64, batch=8),
    "50m": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536, vocab_size=32000, seq=64, batch=4),
    "150m": dict(hidden_size=768, num_hidden_layers=12, intermediate_size=2304, vocab_size=32000, seq=64, batch=4),
}


def build(size: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, int]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(SIZES[size])
    seq, batch = shape.pop("seq"), shape.pop("batch")
    cfg = LlamaConfig(**shape, num_attention_heads=shape["hidden_size"] // 64 or 1,
                      num_key_value_heads=shape["hidden_size"] // 64 or 1, max_position_embeddings=seq)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), {"seq": seq, "batch": batch}


def measure(size: str, rounds: int, steps: int, shm: Path) -> dict[str, Any]:
    from elastictrain import TrainState
    from elastictrain.config import CheckpointConfig
    from elastictrain.runtime.checkpointing import StateCheckpointer
    from elastictrain.runtime.heartbeat import Heartbeat

    model, optim, shape = build(size)
    vocab = model.config.vocab_size
    state = TrainState(model=model, optim=optim)
    os.environ["ELASTICTRAIN_SNAPSHOT_DIR"] = str(shm)
    ckpt = StateCheckpointer(CheckpointConfig(url=str(shm / "durable"), snapshot_every_steps=1, storage_wait_s=0),
                             state, Heartbeat(None), rank=0, world_size=1, fingerprint={})

    def step(snapshot: bool) -> tuple[float, float]:
        t, c = time.perf_counter(), time.process_time()
        ids = torch.randint(0, vocab, (shape["batch"], shape["seq"]))
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
        state.step += 1
        if snapshot:
            ckpt.snapshot_if_due(final=False)
        return time.perf_counter() - t, time.process_time() - c

    try:
        step(True)  # reserve and map the slots' pages, warm the allocator
        step(True)
        per_round = []
        for r in range(rounds):
            blocks: dict[bool, list[tuple[float, float]]] = {}
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                times = [step(on) for _ in range(steps + 1)]
                blocks[on] = times[1:]
            wall = {on: statistics.median(t for t, _ in v) for on, v in blocks.items()}
            cpu = {on: statistics.median(c for _, c in v) for on, v in blocks.items()}
            per_round.append({"step_s_off": wall[False], "step_s_on": wall[True],
                              "wall_ratio": wall[True] / wall[False], "cpu_ratio": cpu[True] / cpu[False]})
        nbytes = ckpt.snapshots.last.nbytes if ckpt.snapshots is not None and ckpt.snapshots.last else None
    finally:
        ckpt.close()
    return {
        "size": size, "params": sum(p.numel() for p in model.parameters()), "snapshot_bytes": nbytes,
        "step_s_off": statistics.median(r["step_s_off"] for r in per_round),
        "wall_ratio": statistics.median(r["wall_ratio"] for r in per_round),
        "cpu_ratio": statistics.median(r["cpu_ratio"] for r in per_round),
        "rounds": per_round,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,50m,150m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=str(HERE / "results" / "snapshot_cost.json"))
    args = ap.parse_args()
    results = []
    for size in args.sizes.split(","):
        shm = Path(tempfile.mkdtemp(prefix="et-snapcost-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        try:
            results.append(measure(size, args.rounds, args.steps, shm))
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        r = results[-1]
        print(f"{size}: {r['params'] / 1e6:.1f}M params, snapshot {r['snapshot_bytes'] / 1e6:.0f} MB, "
              f"step {r['step_s_off']:.3f} s, with snapshots x{r['wall_ratio']:.3f} wall, x{r['cpu_ratio']:.3f} CPU")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    out = {"benchmark": "snapshot_cost", "target_wall_ratio": TARGET_RATIO, "torch": torch.__version__,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "load_avg_at_end": os.getloadavg()},
           "commit": commit.strip(), "rounds": args.rounds, "steps_per_block": args.steps, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
