"""Checkpoint benchmark: async vs sync blocking time, save throughput vs the storage ceiling, load + reshard.

    python benchmarks/checkpoint.py [--params-m 60] [--reps 3] [--out benchmarks/results/checkpoint.json]

One run, on this machine: a ~60M-parameter FSDP2 MLP + AdamW on 2 gloo ranks (CPU). Storage: a local
directory (under --dir, default the system temp dir) and a real S3 server (`rclone serve s3` on loopback
over a directory on the same disk). Ceilings are measured in the same run with the same bytes:
each rank writes its shard-sized buffer with write + fsync (local), or PUTs it (S3), concurrently.
Medians over --reps repetitions; each measurement starts after os.sync() (no dirty pages left over).

Each manager starts as a job does: `load_latest` first (nothing to resume yet), which readies the staging buffers
of async saves; the first async save is reported beside the later ones. For comparison in the same run, before
it: the first async save of a manager that skipped `load_latest` (that save allocates the buffers itself), into
fresh pages (its buffers stay allocated until the target is done, so nothing is recycled by the allocator).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, args: dict[str, Any], workdir: Path) -> list[dict[str, Any]]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "args.json").write_text(json.dumps(args))
    port = _free_port()
    env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(port),
                               str(workdir / "args.json")], cwd=REPO, env=env) for r in range(world)]
    try:
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise SystemExit(f"benchmark worker failed: exit codes {codes}")
    return [json.loads((workdir / f"result-{r}.json").read_text()) for r in range(world)]


# ------------------------------------------------------------------------------------------ worker


def _sharded_model(rank: int, world: int, port: int, args: dict[str, Any], seed: int) -> tuple[Any, Any]:
    """Join a gloo group; an FSDP2 stack of Linear layers with AdamW state (one step taken)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    width, depth = args["width"], args["depth"]
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _worker(rank: int, world: int, port: int, args: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.distributed as dist

    from elastictrain.checkpoint.manager import CheckpointManager
    from elastictrain.checkpoint.storage import open_storage
    from elastictrain.config import CheckpointConfig

    model, opt = _sharded_model(rank, world, port, args, seed=0)
    n_params = sum(p.numel() for p in model.parameters())  # DTensor numel is global

    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    def state() -> dict[str, Any]:
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                "trainer": {"step": 1}, f"rng/rank{rank}": torch.get_rng_state()}

    local_bytes = sum(t.to_local().numel() * t.element_size() for t in
                      list(model.parameters()) + [v for s in opt.state.values() for v in s.values()
                                                  if isinstance(v, torch.Tensor) and v.dim() > 0])
    out: dict[str, Any] = {"params": n_params, "local_bytes": local_bytes}

    def barrier_time(fn) -> float:
        # Every measurement starts with no dirty pages: otherwise whichever write comes second pays for
        # the write-back of the first one (on this VM a burst into the page cache is 5x the sustained rate).
        os.sync()
        dist.barrier()
        t0 = time.monotonic()
        fn()
        dist.barrier()
        return time.monotonic() - t0

    payload = np.random.default_rng(rank).integers(0, 255, size=local_bytes, dtype=np.uint8).tobytes()
    for target in args["targets"]:
        name, url, opts = target["name"], target["url"], target.get("storage_options", {})
        st = open_storage(url, opts)
        # keep_last high: retention deleting the previous checkpoint must not be timed as part of a save
        cfg = CheckpointConfig(url=url, storage_options=opts, keep_last=100, async_save=True)
        # The first save of a manager that never ran load_latest: it allocates its staging buffers itself. After
        # a sync save, as below, so that both first async saves find DCP's own first-call work done.
        cold = CheckpointManager(dataclasses.replace(cfg, url=url.rstrip("/") + "-unprepared"),
                                 fingerprint={"bench": "1"}, rank=rank, world_size=world)
        cold.save(1, state(), blocking=True)
        os.sync()
        dist.barrier()
        t0 = time.monotonic()
        cold.save(2, state())
        unprepared = time.monotonic() - t0
        cold.wait()
        dist.barrier()
        mgr = CheckpointManager(cfg, fingerprint={"bench": "1"}, rank=rank, world_size=world)
        mgr.load_latest(state())  # as a job starts: nothing to resume yet; readies the staging buffers
        ceiling, sync_s, async_block, async_total = [], [], [], []
        step = 0
        # Interleaved per repetition, so that drift in the storage (write-back caches) hits all three alike.
        for rep in range(args["reps"]):
            rel = f"raw/rank{rank}-{rep}.bin"

            def raw() -> None:
                # the ceiling: the same bytes, written raw by both ranks at once (fsync'd / one PUT)
                if st.is_local:
                    p = os.path.join(st.root, rel)
                    os.makedirs(os.path.dirname(p), exist_ok=True)
                    with open(p, "wb") as f:
                        f.write(payload)
                        f.flush()
                        os.fsync(f.fileno())
                else:
                    st.fs.pipe_file(st.path(rel), payload)

            ceiling.append(barrier_time(raw))
            step += 1
            sync_s.append(barrier_time(lambda: mgr.save(step, state(), blocking=True)))
            step += 1
            os.sync()
            dist.barrier()
            t0 = time.monotonic()
            mgr.save(step, state())
            async_block.append(time.monotonic() - t0)
            mgr.wait()
            dist.barrier()
            async_total.append(time.monotonic() - t0)
        dist.barrier()
        if rank == 0:
            st.remove_dir("raw")
        mgr.close()
        cold.close()
        if rank == 0:
            cold.storage.fs.rm(cold.storage.root, recursive=True)
        out[name] = {"ceiling_s": ceiling, "sync_s": sync_s, "async_blocking_s": async_block,
                     "async_total_s": async_total, "async_blocking_unprepared_s": [unprepared],
                     "failures": mgr.consecutive_failures + cold.consecutive_failures}
        # ---- load at this world size (with and without checksum verification); these managers never save, so
        # they ready no staging buffers (which would fault pages in during the next measurement)
        load_s, load_noverify_s = [], []
        load_cfg = dataclasses.replace(cfg, async_save=False)
        for _ in range(args["reps"]):
            for verify, acc in ((True, load_s), (False, load_noverify_s)):
                m = CheckpointManager(load_cfg, fingerprint={"bench": "1"}, rank=rank, world_size=world,
                                      verify_on_load=verify)
                acc.append(barrier_time(lambda: m.load_latest(state())))
        out[name].update(load_s=load_s, load_noverify_s=load_noverify_s)
    dist.barrier()
    dist.destroy_process_group()
    return out


def _load_worker(rank: int, world: int, port: int, args: dict[str, Any]) -> dict[str, Any]:
    """Load the checkpoints written by 2 ranks at another world size (resharding)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from elastictrain.checkpoint.manager import CheckpointManager
    from elastictrain.config import CheckpointConfig

    model, opt = _sharded_model(rank, world, port, args, seed=1)
    out: dict[str, Any] = {}
    for target in args["targets"]:
        cfg = CheckpointConfig(url=target["url"], storage_options=target.get("storage_options", {}),
                               async_save=False)
        times = []
        for _ in range(args["reps"]):
            m = CheckpointManager(cfg, fingerprint={"bench": "1"}, rank=rank, world_size=world)
            dist.barrier()
            t0 = time.monotonic()
            loaded = m.load_latest({"model": get_model_state_dict(model),
                                    "optim": get_optimizer_state_dict(model, opt), "trainer": {"step": 0}})
            dist.barrier()
            times.append(time.monotonic() - t0)
            assert loaded is not None and loaded.world_size == 2
        out[target["name"]] = {"load_s": times}
    dist.destroy_process_group()
    return out


# ------------------------------------------------------------------------------------------ driver


def _med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world, port = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
        args = json.loads(Path(sys.argv[5]).read_text())
        fn = _load_worker if args.get("mode") == "load" else _worker
        res = fn(rank, world, port, args)
        Path(sys.argv[5]).with_name(f"result-{rank}.json").write_text(json.dumps(res))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=float, default=60.0, help="model size in millions of parameters")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the local checkpoints and the S3 data go")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "checkpoint.json"))
    a = ap.parse_args()
    from elastictrain.testing.s3server import S3Server

    width = 2048
    depth = max(1, round(a.params_m * 1e6 / (width * width + width)))
    work = Path(tempfile.mkdtemp(prefix="elastictrain-bench-ckpt-", dir=a.dir))
    server = S3Server(root=str(work / "s3")).start()
    try:
        server.make_bucket("bench")
        targets = [{"name": "local", "url": str(work / "local")},
                   {"name": "s3", "url": "s3://bench/run", "storage_options": server.storage_options()}]
        common = {"width": width, "depth": depth, "reps": a.reps, "targets": targets}
        load_before = os.getloadavg()
        t0 = time.monotonic()
        res = _launch(2, common, work / "run2")
        reload = {w: _launch(w, {**common, "mode": "load"}, work / f"load{w}") for w in (1, 3)}
        wall = time.monotonic() - t0
    finally:
        server.close()
        shutil.rmtree(work, ignore_errors=True)

    r0 = res[0]
    total_bytes = sum(r["local_bytes"] for r in res)
    report: dict[str, Any] = {
        "what": "FSDP2 MLP + AdamW, 2 gloo ranks on CPU; sharded DCP checkpoint via elastictrain CheckpointManager",
        "machine": {"cpus": os.cpu_count(), "torch": __import__("torch").__version__},
        "params": r0["params"], "checkpoint_bytes": total_bytes, "reps": a.reps,
        "bench_wall_s": round(wall, 1), "storage": {},
        # other work on the machine skews every number: the 1-minute load average before and after
        "loadavg_1m": [round(load_before[0], 1), round(os.getloadavg()[0], 1)],
    }
    for t in targets:
        n = t["name"]
        # Per repetition the slowest rank counts (a save is done when every rank is).
        per = lambda key: [max(r[n][key][i] for r in res) for i in range(a.reps)]  # noqa: E731
        sync_s, ceil_s = _med(per("sync_s")), _med(per("ceiling_s"))
        block_s, total_s = _med(per("async_blocking_s")), _med(per("async_total_s"))
        ceil_i, sync_i, total_i = per("ceiling_s"), per("sync_s"), per("async_total_s")
        first_s, later_s = per("async_blocking_s")[0], _med(per("async_blocking_s")[1:] or per("async_blocking_s"))
        unprepared_s = max(r[n]["async_blocking_unprepared_s"][0] for r in res)
        report["storage"][n] = {
            "sync_save_s": sync_s, "async_blocking_s": block_s, "async_total_s": total_s,
            # the first async save after start-up (buffers readied by load_latest) against the later ones
            "async_blocking_first_save_s": round(first_s, 4),
            "async_blocking_later_saves_s": later_s,
            "async_blocking_first_vs_later": round(first_s / later_s, 2),
            "async_blocking_first_vs_sync": round(first_s / sync_s, 4),
            # the same first save without load_latest: it allocates the staging buffers while training waits
            "async_blocking_first_save_unprepared_s": round(unprepared_s, 4),
            "async_blocking_vs_sync": round(block_s / sync_s, 4),
            "sync_save_MBps": round(total_bytes / sync_s / 1e6, 1),
            "async_save_MBps": round(total_bytes / total_s / 1e6, 1),
            "ceiling_MBps": round(total_bytes / ceil_s / 1e6, 1),
            "ceiling_MBps_range": [round(total_bytes / max(ceil_i) / 1e6, 1),
                                   round(total_bytes / min(ceil_i) / 1e6, 1)],
            # ratio per repetition (ceiling and save measured back to back), then the median
            "sync_save_vs_ceiling": round(statistics.median(c / x for c, x in zip(ceil_i, sync_i)), 3),
            "async_save_vs_ceiling": round(statistics.median(c / x for c, x in zip(ceil_i, total_i)), 3),
            "load_w2_s": _med(per("load_s")), "load_w2_noverify_s": _med(per("load_noverify_s")),
            "load_w1_reshard_s": _med([max(x) for x in zip(*(r[n]["load_s"] for r in reload[1]))]),
            "load_w3_reshard_s": _med([max(x) for x in zip(*(r[n]["load_s"] for r in reload[3]))]),
            "failures": max(r[n]["failures"] for r in res),
            "raw": {k: per(k) for k in ("sync_s", "async_blocking_s", "async_total_s", "ceiling_s", "load_s",
                                        "load_noverify_s")},
        }
    report["targets"] = {"async_blocking_vs_sync_max": 0.10, "save_vs_ceiling_min": 0.70}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    sys.stdout.write(json.dumps(report["storage"], indent=2) + "\n")


if __name__ == "__main__":
    main()
