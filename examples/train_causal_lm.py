"""A transformers causal LM (a tiny Llama, random init, nothing downloaded) trained with FSDP2 on elastictrain's API.

    torchrun --nproc-per-node 2 examples/train_causal_lm.py --data notes.txt --checkpoint /tmp/lm-ckpt
    elastictrain run --nproc-per-node 2 examples/train_causal_lm.py --data notes.txt --checkpoint /tmp/lm-ckpt

The data set is fixed-length windows of byte ids cut from a local text file (--data), or synthetic token runs
without one. Kill a worker, a node or the whole job at any point: the next run resumes from the newest checkpoint,
and at the same world size ends bitwise-equal to a run that was never interrupted.
"""

import argparse
import json
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

import elastictrain as et

VOCAB = 256  # byte-level ids: no tokenizer to download


class TokenWindows(Dataset):
    """Map-style: sample i is the i-th window of seq_len + 1 token ids (inputs and their next-token targets)."""

    def __init__(self, path: Optional[str], seq_len: int, n_synthetic: int = 2048):
        if path:
            ids = torch.tensor(list(Path(path).read_bytes()), dtype=torch.long)
            n = (len(ids) - 1) // seq_len
            if n < 1:
                raise SystemExit(f"--data {path}: {len(ids)} bytes, need at least {seq_len + 1}; use a longer file")
            self.windows = ids[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)
        else:  # runs that count up from a random start (mod VOCAB): learnable, so the loss falls
            starts = torch.randint(0, VOCAB, (n_synthetic, 1), generator=torch.Generator().manual_seed(0))
            self.windows = (starts + torch.arange(seq_len + 1)) % VOCAB

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.windows[i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="a local text file (none: synthetic tokens)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--checkpoint", default=None, help="a path or s3://bucket/prefix (none: no checkpoints)")
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--audit-dir", default=None, help="record every step's samples (the exactly-once audit)")
    p.add_argument("--out", default=None, help="rank 0 writes the final state's digest here (JSON)")
    a = p.parse_args()

    with et.Worker(seed=0) as w:  # seeds every rank alike until the first step: the same initial weights everywhere
        data = TokenWindows(a.data, a.seq_len)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                             num_hidden_layers=a.layers, num_attention_heads=2, num_key_value_heads=2,
                             max_position_embeddings=a.seq_len)

        def build() -> et.TrainState:
            """Model, optimizer and scheduler on `w.mesh`: at the start, and again on a smaller world's mesh when a
            node is lost for good under `elastictrain run` with elastic.in_place (`rebuild` below)."""
            model = LlamaForCausalLM(config).to(w.device)
            for layer in model.model.layers:
                fully_shard(layer, mesh=w.mesh)
            fully_shard(model, mesh=w.mesh)
            optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
            return et.TrainState(model=model, optim=optim,
                                 scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=a.steps))

        state = build()
        sampler = state.extras["data"] = et.ElasticSampler(len(data), global_batch_size=a.global_batch,
                                                           micro_batch_size=a.micro_batch)

        options = {"every_steps": a.every} if a.checkpoint else {}
        for _ in w.steps(a.steps, state, checkpoint=a.checkpoint, audit_dir=a.audit_dir, log_every=50,
                         fingerprint={"seq_len": a.seq_len, "hidden": a.hidden, "layers": a.layers},
                         rebuild=build, **options):
            with w.guard():  # with elastic.in_place, a peer's failure pauses this process instead of ending it
                model, optim = state.model, state.optim  # the state's: a smaller world in place replaces them
                for mb in sampler.micro_batches():
                    tokens = torch.stack([data[i] for i in mb.indices]).to(w.device)
                    model.set_requires_gradient_sync(mb.last)
                    logits = model(input_ids=tokens[:, :-1]).logits.float()
                    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                    (loss * mb.weight).backward()
                    w.report(loss=loss.detach() * mb.fraction)
                optim.step()
                state.extras["scheduler"].step()
                optim.zero_grad()
                del model, optim

        digest = state.digest()
        if w.is_main and a.out:
            with open(a.out, "w") as f:
                json.dump({"step": state.step, "world_size": w.world_size, "stopped": w.stopped,
                           "loss": w.metrics.get("loss"), **digest}, f)


if __name__ == "__main__":
    main()
