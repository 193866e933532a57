"""What a durable (T1) checkpoint save blocks training for: written from the in-memory snapshot vs staged from the
live state, first save after a (re)start and later ones, at several model sizes, side by side in one run.

    python benchmarks/durable_blocking.py [--sizes tiny,50m,150m] [--saves 3] [--every 3] [--out PATH]

One process (no process group: staging and the snapshot copy are per rank), a transformers Llama of each size with
AdamW on random tokens, the public API's `StateCheckpointer` driven as the step loop drives it, a durable checkpoint
every `--every` steps (async, to a local directory) and, where on, a snapshot after every step on /dev/shm. Modes:

- `live`: no snapshots; an async save stages a copy of the state (into buffers prepared after the first step);
- `live+snapshots`: snapshots every step, but the durable save still staged from the live state (before #14's
  durable-from-snapshot: two copies of the state at a save step);
- `from_snapshot`: snapshots every step, the durable save written from the committed snapshot slot.

Each mode starts from a fresh `StateCheckpointer` (as after a restart: `restore()` finds nothing) and saves
`--saves` times. Measured per save: `blocking_s`, the time the step loop spent in the save (in `after_step`, plus,
for `from_snapshot`, the extra in the next optimizer step's pre-hook, where the save starts once the snapshot is
committed, over that pre-hook's median at steps without a save); and the wall time of the save step and the next
one over twice the median step of the same mode (`window_extra_s`, which also shows the upload competing for the
cores). Medians over the later saves; the first save after the restart is reported on its own.

Writes benchmarks/results/durable_blocking.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.snapshot_cost import SIZES, build  # noqa: E402

MODES = ("live", "live+snapshots", "from_snapshot")


def run_mode(mode: str, size: str, saves: int, every: int, shm: Path, disk: Path) -> dict[str, Any]:
    from elastictrain import TrainState
    from elastictrain.config import CheckpointConfig
    from elastictrain.runtime.checkpointing import StateCheckpointer
    from elastictrain.runtime.heartbeat import Heartbeat

    model, optim, shape = build(size)
    vocab = model.config.vocab_size
    state = TrainState(model=model, optim=optim)
    os.environ["ELASTICTRAIN_SNAPSHOT_DIR"] = str(shm / mode)
    cfg = CheckpointConfig(url=str(disk / mode), snapshot_every_steps=0 if mode == "live" else 1,
                           every_steps=every, storage_wait_s=0, keep_last=2)
    ckpt = StateCheckpointer(cfg, state, Heartbeat(None), rank=0, world_size=1, fingerprint={})
    if mode == "live+snapshots":
        ckpt.mgr.saves_from_snapshots = False
    ckpt.restore()
    hook_s: list[float] = []
    finish = ckpt._finish_snapshot

    def timed_finish() -> None:
        t = time.perf_counter()
        finish()
        hook_s.append(time.perf_counter() - t)

    ckpt._finish_snapshot = timed_finish  # the optimizer pre-hook calls it through the instance
    steps: list[dict[str, float]] = []
    try:
        for _ in range(saves * every + 1):
            t0 = time.perf_counter()
            ids = torch.randint(0, vocab, (shape["batch"], shape["seq"]))
            model(input_ids=ids, labels=ids).loss.backward()
            hook_s.clear()
            optim.step()
            optim.zero_grad()
            state.step += 1
            ckpt.snapshot_if_due(final=False)
            t1 = time.perf_counter()
            ckpt.after_step(final=False, stopping=False)
            t2 = time.perf_counter()
            steps.append({"step": state.step, "wall": t2 - t0, "after_step": t2 - t1, "hook": sum(hook_s)})
            if state.step % every == 0:
                ckpt.mgr.wait()  # a save per interval: the upload is done before the next one is due
        saved = ckpt.mgr.last_committed
    finally:
        ckpt.close()
    due = [s["step"] for s in steps if s["step"] % every == 0]
    plain = [s for s in steps if s["step"] % every not in (0, 1) and s["step"] > 1]
    median_wall = statistics.median(s["wall"] for s in plain)
    median_hook = statistics.median(s["hook"] for s in plain)
    by_step = {s["step"]: s for s in steps}
    per_save = []
    for d in due:
        nxt = by_step.get(d + 1)
        if nxt is None:
            continue
        hook_extra = max(0.0, nxt["hook"] - median_hook) if mode == "from_snapshot" else 0.0
        per_save.append({"step": d, "blocking_s": by_step[d]["after_step"] + hook_extra,
                         "window_extra_s": by_step[d]["wall"] + nxt["wall"] - 2 * median_wall})
    assert saved == due[-1] or saved == due[-2], (mode, saved, due)
    later = per_save[1:] or per_save
    return {"mode": mode, "step_s": median_wall, "first": per_save[0],
            "blocking_s": statistics.median(p["blocking_s"] for p in later),
            "window_extra_s": statistics.median(p["window_extra_s"] for p in later), "saves": per_save}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,50m,150m")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "durable_blocking.json"))
    ap.add_argument("--note", default="", help="free text kept in the JSON (what else ran, where the code came from)")
    args = ap.parse_args()
    results = []
    for size in args.sizes.split(","):
        shm = Path(tempfile.mkdtemp(prefix="et-durable-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        disk = Path(tempfile.mkdtemp(prefix="et-durable-"))
        try:
            modes = [run_mode(m, size, args.saves, args.every, shm, disk) for m in MODES]
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(disk, ignore_errors=True)
        model, _, _ = build(size)
        params = sum(p.numel() for p in model.parameters())
        results.append({"size": size, "params": params, "train_state_mb": params * 12 / 1e6, "modes": modes})
        for m in modes:
            print(f"{size} {m['mode']:>15}: step {m['step_s']:.3f} s, save blocks {m['blocking_s']:.3f} s "
                  f"(first after start {m['first']['blocking_s']:.3f} s), save window +{m['window_extra_s']:.3f} s")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    out = {"benchmark": "durable_blocking", "torch": torch.__version__, "commit": commit.strip(),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_at_end": os.getloadavg()},
           "note": args.note, "saves": args.saves, "every": args.every, "sizes": SIZES, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
