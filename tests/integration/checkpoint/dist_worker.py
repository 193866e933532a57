"""Multi-process scenarios for the checkpoint integration tests: one OS process per rank, gloo, FSDP2.

The model is a small MLP wrapped with `fully_shard` and trained with AdamW on a batch that is a pure
function of the step, so that runs can be compared bitwise. Each rank writes `result-<rank>.json`;
rank 0 also writes full (unsharded) model + optimizer state dicts as `<tag>.pt` for comparison.

Run as `python -m tests.integration.checkpoint.dist_worker <rank> <world> <port> <args.json>`;
`launch()` does that for every rank and collects the results.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from elastictrain.testing.ranks import run_ranks

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, args: dict[str, Any], out: Path, timeout_s: float = 120.0,
           expect_exit: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """Run `args["scenario"]` on `world` ranks; returns each rank's result (raises on failure/timeout)."""
    out.mkdir(parents=True, exist_ok=True)
    args = {**args, "out": str(out)}
    (out / "args.json").write_text(json.dumps(args))
    port = free_port()
    # MASTER_ADDR: DCP's process-mode checkpointer would otherwise rendezvous on the host's FQDN.
    env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    codes = run_ranks(lambda r: [sys.executable, "-m", "tests.integration.checkpoint.dist_worker", str(r), str(world),
                                 str(port), str(out / "args.json")], world, out, timeout_s, env=env, cwd=REPO)
    expect_exit = expect_exit or {}
    results = []
    for r, code in enumerate(codes):
        want = expect_exit.get(r, 0)
        if code != want:
            tail = (out / f"rank{r}.log").read_text(errors="replace")[-4000:]
            raise AssertionError(f"rank {r} exited with {code} (expected {want}):\n{tail}")
        f = out / f"result-{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else {})
    return results


# --------------------------------------------------------------------------------------------------
# inside a rank


def _setup(rank: int, world: int, port: int):
    import torch
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return torch, dist


def _build(seed: int, world: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Linear(48, 48), torch.nn.GELU(),
                                torch.nn.Linear(48, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, opt


class _ModelState:
    def __init__(self, model):
        self.model = model

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(self.model, sd)


class _OptimState:
    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        set_optimizer_state_dict(self.model, self.opt, sd)


def _train_step(model, opt, step: int, rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(12, 16, generator=g)
    y = torch.randn(12, 8, generator=g)
    mine = slice(rank * 12 // world, (rank + 1) * 12 // world)
    # Sum over my share / global count: the gradient average over ranks is the global-batch mean.
    loss = ((model(x[mine]) - y[mine]) ** 2).sum() / (12 * 8) * world
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach() / world
    dist.all_reduce(total)
    return float(total)


def _dump_full(model, opt, path: str, rank: int) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, opt, options=opts)
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, path)


def _manager(args: dict, rank: int, world: int, events: list, **over):
    from elastictrain.checkpoint.manager import CheckpointManager
    from elastictrain.config import CheckpointConfig

    cfg = CheckpointConfig(url=args["url"], storage_options=args.get("storage_options", {}),
                           every_steps=args.get("every_steps", 2), keep_last=args.get("keep_last", 5),
                           async_mode=args.get("async_mode", "thread"), resume=args.get("resume", "auto"))
    for k, v in over.items():
        setattr(cfg, k, v)
    fp = args.get("fingerprint", {"model": "mlp-48", "data": "synthetic", "seed": "0"})
    return CheckpointManager(cfg, fingerprint=fp, rank=rank, world_size=world,
                             on_event=lambda n, f: events.append([n, f]))


def _sha(t) -> str:
    import hashlib
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _state(model, opt, rank: int, trainer: dict) -> dict:
    import torch
    return {"model": _ModelState(model), "optim": _OptimState(model, opt), "trainer": trainer,
            f"rng/rank{rank}": torch.get_rng_state()}


def scenario_train(args: dict, rank: int, world: int) -> dict:
    """Train `steps` steps, saving every `every_steps` (async); dump full state at `dump_at` steps."""
    import torch

    from elastictrain.checkpoint import commit

    out = args["out"]
    slow = float(args.get("slow_upload_s", 0.0))
    if slow:
        commit.PHASE_HOOK = lambda phase, r, step: time.sleep(slow) if phase == "before_data" else None
    model, opt = _build(0, world)
    events: list = []
    mgr = _manager(args, rank, world, events)
    trainer = {"step": 0, "samples": 0}
    assert mgr.load_latest(_state(model, opt, rank, trainer)) is None
    blocking, losses = {}, []
    for step in range(1, args["steps"] + 1):
        losses.append(_train_step(model, opt, step, rank, world))
        trainer.update(step=step, samples=step * 12)
        if mgr.should_save(step):
            mgr.wait()  # else a save due while the previous one uploads is skipped; here every save must land
            t0 = time.monotonic()
            mgr.save(step, _state(model, opt, rank, trainer))
            blocking[step] = time.monotonic() - t0
        if step in args.get("dump_at", []):
            _dump_full(model, opt, os.path.join(out, f"ref_step{step}.pt"), rank)
    t0 = time.monotonic()
    mgr.close()
    return {"events": events, "blocking": blocking, "close_s": time.monotonic() - t0, "losses": losses,
            "rng_sha": _sha(torch.get_rng_state())}


def scenario_resume(args: dict, rank: int, world: int) -> dict:
    """Load the latest checkpoint into a differently initialised model; dump it; optionally keep training."""

    model, opt = _build(123, world)
    events: list = []
    mgr = _manager(args, rank, world, events)
    trainer = {"step": -1, "samples": -1}
    state = _state(model, opt, rank, trainer)
    from elastictrain.errors import CheckpointMismatchError
    try:
        loaded = mgr.load_latest(state)
    except CheckpointMismatchError as e:
        return {"mismatch": str(e)}
    _dump_full(model, opt, os.path.join(args["out"], f"loaded_w{world}.pt"), rank)
    rng_key = f"rng/rank{rank}"
    rng_sha = None if rng_key in loaded.missing_keys else _sha(state[rng_key])
    losses = []
    for step in range(loaded.step + 1, args.get("continue_to", loaded.step) + 1):
        losses.append(_train_step(model, opt, step, rank, world))
    if args.get("continue_to"):
        _dump_full(model, opt, os.path.join(args["out"], f"cont_w{world}_step{args['continue_to']}.pt"), rank)
    mgr.close()
    return {"step": loaded.step, "ckpt_world_size": loaded.world_size, "missing_keys": loaded.missing_keys,
            "trainer": trainer, "events": events, "rng_sha": rng_sha, "losses": losses}


def scenario_s3_outage(args: dict, rank: int, world: int) -> dict:
    """The S3 server goes away at the start of the step-4 upload and comes back before step 6."""
    import torch.distributed as dist

    from elastictrain.checkpoint import commit
    from elastictrain.testing.s3server import S3Server

    server = None
    if rank == 0:
        server = S3Server(root=args["s3_root"], port=args["s3_port"], access_key=args["key"],
                          secret_key=args["secret"]).start()
    dist.barrier()

    def outage(phase: str, r: int, step: int) -> None:
        if phase == "before_data" and step == 4 and server is not None:
            server.stop()

    commit.PHASE_HOOK = outage
    model, opt = _build(0, world)
    events: list = []
    mgr = _manager(args, rank, world, events)
    trainer = {"step": 0, "samples": 0}
    trained = []
    for step in range(1, 9):
        _train_step(model, opt, step, rank, world)
        trained.append(step)
        trainer.update(step=step, samples=step * 12)
        if mgr.should_save(step):
            mgr.wait()  # else a save due while the previous one uploads is skipped; here every save must land
            mgr.save(step, _state(model, opt, rank, trainer))
        if step == 5:
            mgr.wait()  # the failed upload is over before the server returns, so it cannot succeed late
            if server is not None:
                server.start()
            dist.barrier()
    mgr.close()
    _dump_full(model, opt, os.path.join(args["out"], "ref_step8.pt"), rank)
    events2: list = []
    loaded = _manager(args, rank, world, events2).load_latest(_state(*_build(7, world), rank, {"step": -1}))
    if server is not None:
        server.close()  # the test owns the data directory; close() drops only the server's log
    return {"events": events, "trained": trained, "loaded_step": loaded.step if loaded else None}


def scenario_kill_phase(args: dict, rank: int, world: int) -> dict:
    """Save step 2 (committed), then die (SIGKILL-like, no cleanup) in `phase` of the step-4 save."""
    from elastictrain.checkpoint import commit

    model, opt = _build(0, world)
    events: list = []
    mgr = _manager(args, rank, world, events)
    trainer = {"step": 0}
    for step in range(1, 5):
        _train_step(model, opt, step, rank, world)
        trainer["step"] = step
        if step == 4:
            mgr.wait()  # step 2 is committed before the fault is armed
            commit.PHASE_HOOK = lambda phase, r, s: os._exit(137) if phase == args["phase"] else None
        if mgr.should_save(step):
            mgr.save(step, _state(model, opt, rank, trainer), blocking=args.get("blocking", False))
    mgr.close()
    return {"events": events}


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    args = json.loads(Path(sys.argv[4]).read_text())
    import logging
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    torch, dist = _setup(rank, world, port)
    fn = globals()[f"scenario_{args['scenario']}"]
    result = fn(args, rank, world)
    Path(args["out"], f"result-{rank}.json").write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
