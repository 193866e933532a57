"""One rank of the snapshot reshard tests: FSDP2 over gloo, a small MLP whose dim-0 sizes (5, 3, 2) do not divide
by 2 or 3, AdamW, a scheduler and an `ElasticSampler`, checkpointed by the real `StateCheckpointer` (in-memory
snapshots every step, a durable checkpoint every 2 steps).

`save` trains 3 steps (snapshots of steps 1-3, a durable checkpoint of step 2); `restore` builds the same job from
other initial weights and restores (the snapshot of step 3 at another world size), then loads the durable checkpoint
of step 2 at the same size, timed for comparison. `in_place_min` in the arguments sets the size from which received
bytes go straight into the state (`snapshot_reshard.IN_PLACE_MIN`). Each rank writes `result-<rank>.json`: the
full-state digests (a collective over the gathered parameters and optimizer state), step, data position, learning
rate, the samples it plans for the next step, where it resumed from and the checkpoint events.

Run as `python -m tests.integration.checkpoint.snapshot_reshard_worker <rank> <world> <port> <args.json>`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

FINGERPRINT = {"model": "mlp-5-3-2"}
NUM_SAMPLES, GLOBAL_BATCH, SEED = 60, 6, 3


def _job(rank: int, world: int, args: dict[str, Any]):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elastictrain import ElasticSampler, TrainState
    from elastictrain.config import CheckpointConfig
    from elastictrain.runtime.checkpointing import StateCheckpointer
    from elastictrain.runtime.heartbeat import Heartbeat

    torch.manual_seed(0 if args["scenario"] == "save" else 99)  # a restore must overwrite every value
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3), torch.nn.ReLU(),
                                torch.nn.Linear(3, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    # As the recipe: two parameter groups (no weight decay on 1-D parameters), a warmup then a decay.
    params = list(model.parameters())
    optim = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                               {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / 2) * 0.9 ** step)
    sampler = ElasticSampler(NUM_SAMPLES, global_batch_size=GLOBAL_BATCH, micro_batch_size=1, seed=SEED)
    state = TrainState(model=model, optim=optim, scheduler=sched, data=sampler)
    cfg = CheckpointConfig(url=args["url"], every_steps=2, snapshot_every_steps=1, async_save=False, keep_last=10,
                           storage_wait_s=0)
    ckpt = StateCheckpointer(cfg, state, Heartbeat(None), rank=rank, world_size=world, fingerprint=FINGERPRINT)
    events: list = []
    ckpt._emit = lambda name, fields: events.append([name, fields])
    return state, ckpt, events


def _train_step(state) -> None:
    import torch

    model, optim = state.model, state.optim
    for mb in state.extras["data"].micro_batches():
        x = torch.stack([torch.randn(4, generator=torch.Generator().manual_seed(i)) for i in mb.indices])
        model.set_requires_gradient_sync(mb.last)
        (model(x).square().mean() * mb.weight).backward()
    optim.step()
    state.extras["scheduler"].step()
    optim.zero_grad()
    state.extras["data"].advance()
    state.step += 1


def _snapshot(state, ckpt) -> dict[str, Any]:
    sampler = state.extras["data"]
    out = {"digest": state.digest(), "step": state.step, "samples_consumed": sampler.samples_consumed,
           "lr": state.optim.param_groups[0]["lr"], "scheduler": state.extras["scheduler"].state_dict(),
           "param_groups": state.optim.state_dict()["param_groups"]}
    sampler.micro_batches()  # the next step's plan (the sampler moves on only when a step ends)
    out["next_samples"] = sampler.last_planned
    return out


def main(rank: int, world: int, port: int, args_path: str) -> None:
    args = json.loads(Path(args_path).read_text())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="reshard-run",
                      ELASTICTRAIN_SNAPSHOT_DIR=args["roots"][rank], LOCAL_RANK=str(args["local_ranks"][rank]))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    if "in_place_min" in args:  # this MLP's items are far below the default: received straight into place all the same
        from elastictrain.checkpoint import snapshot_reshard

        snapshot_reshard.IN_PLACE_MIN = args["in_place_min"]
    state, ckpt, events = _job(rank, world, args)
    result: dict[str, Any] = {}
    if args["scenario"] == "save":
        for _ in range(3):
            _train_step(state)
            ckpt.snapshot_if_due(final=False)
            ckpt.after_step(final=False, stopping=False)
        ckpt._finish_snapshot()
        result = _snapshot(state, ckpt)
    else:
        started = time.monotonic()
        resumed = ckpt.restore()
        result = {"restore_s": time.monotonic() - started, "resumed": resumed and resumed.source,
                  "reseed": resumed and resumed.reseed, **_snapshot(state, ckpt)}
        started = time.monotonic()
        loaded = ckpt.mgr.load_latest(state.checkpoint_state(rank, for_load=True))
        result["durable_load_s"], result["durable_step"] = time.monotonic() - started, loaded and loaded.step
    result["events"] = events
    ckpt.close()
    Path(args["out"], f"result-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    # Everything is written and the group destroyed; the interpreter's teardown of torch's objects now and then
    # aborts the process under torch 2.13 ("terminate called without an active exception", exit -6 in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
