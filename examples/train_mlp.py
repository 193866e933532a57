"""A plain PyTorch model (an MLP, no transformers) trained with FSDP2 on elastictrain's public API.

    torchrun --nproc-per-node 2 examples/train_mlp.py --checkpoint /tmp/mlp-ckpt
    elastictrain run --nproc-per-node 2 examples/train_mlp.py --checkpoint /tmp/mlp-ckpt

Kill a worker, a node or the whole job at any point: the next run resumes from the newest checkpoint, and at the
same world size ends bitwise-equal to a run that was never interrupted.
"""

import argparse
import json

import torch
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

import elastictrain as et


def make_dataset(n: int, dim: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    y = (x @ torch.randn(dim, 1, generator=g)).tanh() + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--checkpoint", default=None, help="a path or s3://bucket/prefix (none: no checkpoints)")
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--audit-dir", default=None, help="record every step's samples (the exactly-once audit)")
    p.add_argument("--out", default=None, help="rank 0 writes the final state's digest here (JSON)")
    a = p.parse_args()

    with et.Worker(seed=0) as w:
        data = make_dataset(4096, a.dim)

        def build() -> et.TrainState:
            """Model, optimizer and scheduler on `w.mesh`: at the start, and again on a smaller world's mesh when a
            node is lost for good under `elastictrain run` with elastic.in_place (`rebuild` below)."""
            model = torch.nn.Sequential(torch.nn.Linear(a.dim, a.hidden), torch.nn.GELU(),
                                        torch.nn.Linear(a.hidden, a.hidden), torch.nn.GELU(),
                                        torch.nn.Linear(a.hidden, 1)).to(w.device)
            for layer in model[::2]:
                fully_shard(layer, mesh=w.mesh)
            fully_shard(model, mesh=w.mesh)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
            return et.TrainState(model=model, optim=optim,
                                 scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=a.steps))

        sampler = et.ElasticSampler(len(data), global_batch_size=a.global_batch, micro_batch_size=a.micro_batch)
        state = build()
        state.extras["data"] = sampler

        options = {"every_steps": a.every} if a.checkpoint else {}
        for _ in w.steps(a.steps, state, checkpoint=a.checkpoint, audit_dir=a.audit_dir, log_every=50,
                         fingerprint={"dim": a.dim, "hidden": a.hidden}, rebuild=build, **options):
            with w.guard():  # with elastic.in_place, a peer's failure pauses this process instead of ending it
                model, optim = state.model, state.optim  # the state's: a smaller world in place replaces them
                for mb in sampler.micro_batches():
                    x, y = (t.to(w.device) for t in data[mb.indices])
                    model.set_requires_gradient_sync(mb.last)
                    loss = torch.nn.functional.mse_loss(model(x), y)
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
