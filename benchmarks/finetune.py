"""Checkpoint volume and save time of fine-tuning, with and without delta checkpoints and compression, and the load
time of pretrained weights against building a model from its config.

    python benchmarks/finetune.py [--size 100m] [--saves 3] [--modes ...] [--out PATH] [--note TEXT]

One process (no process group for the saves), a transformers Llama of ~106M parameters (hidden 768, 8 layers,
intermediate 2048, vocab 32000, untied head) with AdamW, saved with `CheckpointManager.save(blocking=True)` to a
local directory after each "step" (an AdamW step over random gradients: every trained tensor and its moments
change, every frozen one keeps its bytes, which is what matters to a delta checkpoint; no forward pass). Modes:

- `full`: every parameter trained, the full state saved;
- `frozen_half/state`: embeddings, the LM head and the first half of the blocks frozen (requires_grad off), the
  full model state saved (a job that freezes outside `model.freeze`, or a plain full-state checkpoint);
- `frozen_half/trainable_only`: the same with `TrainState(trainable_only=True)` (what `model.freeze` does);
- `lora/state`: a LoRA adapter (r=16 on q,k,v,o via peft), the whole model state saved (what a framework that
  saves full checkpoints of a LoRA job writes; the setting of ms-swift's -70% claim);
- `lora/trainable_only`: adapter and its optimizer state only (what `model.lora` does).

Each mode x {dedup off, on} x {compression none, zstd} saves `--saves` times. Measured per save: the bytes it added
to the checkpoint root (a delta checkpoint's new blobs plus its own files) and the seconds `save` blocked (all of
the save: blocking). Reported: the first save, and the median of the later ones (the steady state a long job sees).
`saving_vs_plain`: 1 - steady bytes / the plain (no dedup, no compression) steady bytes of the same mode.

Load: the recipe's `build_sharded` + `fill_weights` on a one-rank gloo group, once with model.init=pretrained from a
safetensors directory of the same model (`save_pretrained`), once with random init from the config; medians.

Writes benchmarks/results/finetune.json.
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
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SHAPES = {
    "100m": dict(hidden_size=768, num_hidden_layers=8, intermediate_size=2048, vocab_size=32000),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=256),
}
MODES = ("full", "frozen_half/state", "frozen_half/trainable_only", "lora/state", "lora/trainable_only")
VARIANTS = (("plain", False, "none"), ("dedup", True, "none"), ("zstd", False, "zstd"), ("dedup+zstd", True, "zstd"))


def hf_config(size: str) -> Any:
    from transformers import LlamaConfig

    s = SHAPES[size]
    heads = max(1, s["hidden_size"] // 64)
    return LlamaConfig(**s, num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=256,
                       tie_word_embeddings=False)


def build(size: str, mode: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, bool]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config(size))
    kind, _, saved = mode.partition("/")
    if kind == "frozen_half":
        n = model.config.num_hidden_layers
        for name, p in model.named_parameters():
            layer = name.split(".")[2] if name.startswith("model.layers.") else None
            if "embed_tokens" in name or name.startswith("lm_head") or (layer is not None and int(layer) < n // 2):
                p.requires_grad_(False)
    elif kind == "lora":
        from peft import LoraConfig, inject_adapter_in_model

        model = inject_adapter_in_model(LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                         "o_proj"]), model)
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-4), saved == "trainable_only"


def fake_step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p) * 1e-3
    optim.step()
    optim.zero_grad(set_to_none=True)


def du(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def run_variant(model: torch.nn.Module, optim: torch.optim.Optimizer, trainable_only: bool, dedup: bool,
                compression: str, saves: int, root: Path) -> dict[str, Any]:
    from elastictrain import TrainState
    from elastictrain.checkpoint.manager import CheckpointManager
    from elastictrain.config import CheckpointConfig

    state = TrainState(model=model, optim=optim, trainable_only=trainable_only)
    cfg = CheckpointConfig(url=str(root), async_save=False, keep_last=saves + 1, dedup=dedup,
                           compression=compression)
    mgr = CheckpointManager(cfg, fingerprint={})
    added, seconds = [], []
    for _ in range(saves):
        fake_step(model, optim)
        state.step += 1
        before = du(root) if root.exists() else 0
        t0 = time.perf_counter()
        assert mgr.save(state.step, state.checkpoint_state(0), blocking=True), mgr.last_error
        seconds.append(time.perf_counter() - t0)
        added.append(du(root) - before)
    mgr.close()
    later_b, later_s = added[1:] or added, seconds[1:] or seconds
    return {"first_bytes": added[0], "first_s": round(seconds[0], 3),
            "steady_bytes": int(statistics.median(later_b)), "steady_s": round(statistics.median(later_s), 3),
            "bytes_per_save": added, "seconds_per_save": [round(s, 3) for s in seconds]}


def measure_saves(size: str, modes: list[str], saves: int, disk: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in modes:
        model, optim, trainable_only = build(size, mode)
        params = sum(p.numel() for p in model.parameters())
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        rows: dict[str, Any] = {"parameters": params, "trained_parameters": trained}
        for name, dedup, compression in VARIANTS:
            root = disk / mode.replace("/", "-") / name
            rows[name] = run_variant(model, optim, trainable_only, dedup, compression, saves, root)
            shutil.rmtree(root, ignore_errors=True)
            r = rows[name]
            print(f"{mode:28s} {name:10s} first {r['first_bytes'] / 1e6:8.1f} MB {r['first_s']:6.2f} s"
                  f"  steady {r['steady_bytes'] / 1e6:8.1f} MB {r['steady_s']:6.2f} s", flush=True)
        plain = rows["plain"]["steady_bytes"]
        for name, _, _ in VARIANTS:
            rows[name]["saving_vs_plain"] = round(1 - rows[name]["steady_bytes"] / plain, 3) if plain else None
        out[mode] = rows
        del model, optim
    return out


def measure_load(size: str, trials: int, disk: Path) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    from elastictrain.config import ModelConfig, TrainConfig
    from elastictrain.recipes.model import build_sharded, fill_weights

    path = disk / "pretrained"
    torch.manual_seed(0)
    LlamaForCausalLM(hf_config(size)).save_pretrained(path, safe_serialization=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    results: dict[str, list[float]] = {"pretrained": [], "random": []}
    try:
        for _ in range(trials):
            for init in ("pretrained", "random"):
                heads = max(1, SHAPES[size]["hidden_size"] // 64)
                overrides = {**SHAPES[size], "num_attention_heads": heads, "num_key_value_heads": heads,
                             "max_position_embeddings": 256, "tie_word_embeddings": False}
                cfg = ModelConfig(name="llama", path=str(path) if init == "pretrained" else None, init=init,
                                  overrides={} if init == "pretrained" else overrides)
                t0 = time.perf_counter()
                model = build_sharded(cfg, mesh, TrainConfig(), torch.device("cpu"))
                fill_weights(model, cfg, seed=0)
                results[init].append(time.perf_counter() - t0)
                del model
    finally:
        dist.destroy_process_group()
    return {"pretrained_s": round(statistics.median(results["pretrained"]), 3),
            "from_config_random_s": round(statistics.median(results["random"]), 3),
            "trials": {k: [round(x, 3) for x in v] for k, v in results.items()},
            "what": "build_sharded + fill_weights on one rank: model.init=pretrained (safetensors via DCP's Hugging "
                    "Face reader) vs random init from the config (each rank builds the full model and keeps its "
                    "shards)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="100m", choices=sorted(SHAPES))
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--load-trials", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=str(HERE / "results" / "finetune.json"))
    ap.add_argument("--note", default="", help="free text kept in the JSON (what else ran, where the code came from)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    disk = Path(tempfile.mkdtemp(prefix="finetune-bench-"))
    try:
        saves = measure_saves(args.size, args.modes.split(","), args.saves, disk)
        load = measure_load(args.size, args.load_trials, disk)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    out = {"benchmark": "finetune", "size": args.size, "shape": SHAPES[args.size], "saves_per_variant": args.saves,
           "commit": commit.strip(), "note": args.note, "torch": torch.__version__,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_at_end": os.getloadavg()},
           "checkpoints": saves, "load": load}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
