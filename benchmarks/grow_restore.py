"""The restore of a grow or a shrink in place, alone: a snapshot loaded at another world size (#15).

    python benchmarks/grow_restore.py [--sizes tiny,50m,150m] [--cases grow,shrink] [--rounds 3] [--profile]
                                      [--out PATH]

What a node that takes a lost place back pays in the pause, without the agents, etcd or the training around it:
one process (world 1, node a) trains a step of scale.py's Llama of each size with FSDP2 over gloo and writes its
in-memory snapshot (a durable checkpoint of the same step too); then, per round, two fresh processes (world 2: rank
0 on node a, rank 1 on node c, which holds nothing) restore it through the real `StateCheckpointer.restore`, the
path `elastic.in_place` takes after a grow: the old slot's layouts gathered, each rank's DCP load plan, the byte
ranges rank 1 needs sent over the process group by rank 0, the load. Each round records the parts the
`checkpoint_snapshot_loaded` event gives (plan, read/receive, load: each until the slowest rank is done), the
bytes moved, the model's build on the new mesh, and for comparison the durable checkpoint of the same step loaded
at world size 2 by the same processes. `shrink` is the other direction: two ranks (nodes a and b) save, node b is
lost for good, and one rank on node a restores with b's slot read from its replica there (what a survivor pays
after a node loss, on top of the lease's TTL). `--profile` adds each rank's cProfile of the restore (top functions by
cumulative time) to the JSON.

Node folders live on /dev/shm as under the agent; the durable checkpoint in a temporary directory. Medians over the
rounds. Writes benchmarks/results/grow_restore.json.
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

from elastictrain.testing.ranks import run_worker_script, worker_entry

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

FINGERPRINT = {"model": "grow-restore"}
SEQ, BATCH = 16, 2


def _model_config(size: str):
    from scale import SIZES

    from elastictrain.config import ModelConfig

    return ModelConfig(name="llama", overrides={**SIZES[size], "vocab_size": 256, "max_position_embeddings": 512})


def _worker(rank: int, world: int, port: int, args: dict[str, Any]) -> dict[str, Any]:
    """One rank: `save` (world 1) trains a step and snapshots it; `restore` builds the job and restores."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="grow-restore",
                      ELASTICTRAIN_SNAPSHOT_DIR=args["roots"][rank], LOCAL_RANK="0")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from elastictrain import ElasticSampler, TrainState
    from elastictrain.config import CheckpointConfig, OptimConfig, TrainConfig
    from elastictrain.recipes.model import build_optimizer, build_sharded, fill_weights
    from elastictrain.runtime.checkpointing import StateCheckpointer
    from elastictrain.runtime.heartbeat import Heartbeat

    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = _model_config(args["size"])
    started = time.monotonic()
    model = build_sharded(cfg, init_device_mesh("cpu", (world,)), TrainConfig(precision="fp32"), torch.device("cpu"))
    out: dict[str, Any] = {"build_s": time.monotonic() - started}
    optim, sched = build_optimizer(model, OptimConfig(), total_steps=100)
    sampler = ElasticSampler(64, global_batch_size=BATCH, micro_batch_size=BATCH, seed=0)
    state = TrainState(model=model, optim=optim, scheduler=sched, data=sampler)
    ckpt_cfg = CheckpointConfig(url=args["url"], every_steps=1, snapshot_every_steps=1, async_save=False,
                                keep_last=2, storage_wait_s=0)
    ckpt = StateCheckpointer(ckpt_cfg, state, Heartbeat(None), rank=rank, world_size=world, fingerprint=FINGERPRINT)
    events: list = []
    ckpt._emit = lambda name, fields: events.append([name, fields])
    if args["scenario"] == "save":
        fill_weights(model, cfg, seed=0)
        for mb in sampler.micro_batches():
            seeded = torch.Generator().manual_seed(mb.indices[0])
            tokens = torch.randint(0, 256, (len(mb.indices), SEQ), generator=seeded)
            model(input_ids=tokens, labels=tokens).loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad()
        sampler.advance()
        state.step += 1
        ckpt.snapshot_if_due(final=False)
        ckpt.after_step(final=False, stopping=False)
        ckpt._finish_snapshot()
        out["digest"] = state.digest()
    else:
        profile = None
        if args.get("profile"):
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
        dist.barrier()  # both ranks built: the parts are the restore's own, not one rank waiting for the other's build
        started = time.monotonic()
        resumed = ckpt.restore()
        out["restore_s"] = time.monotonic() - started
        if profile is not None:
            import io
            import pstats

            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
            out["profile"] = text.getvalue()
        out["resumed"] = resumed and resumed.source
        out["digest"] = state.digest()
        started = time.monotonic()
        loaded = ckpt.mgr.load_latest(state.checkpoint_state(rank, for_load=True))
        out["durable_load_s"], out["durable_step"] = time.monotonic() - started, loaded and loaded.step
    out["events"] = [e for e in events if e[0].startswith("checkpoint_snapshot")]
    ckpt.close()
    dist.destroy_process_group()
    return out


def _launch(work: Path, roots: list[Path], args: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return run_worker_script(__file__, work, len(roots), {**args, "roots": [str(r) for r in roots]}, timeout,
                             env=env, cwd=REPO)


CASES = {"grow": ("a", "ac"), "shrink": ("ab", "a")}
"""Case -> (the nodes of the saving ranks, one rank each; the nodes of the restoring ranks). grow: a node took a lost
place back (rank 1 on node c receives its rows from rank 0 over the group); shrink: node b lost for good, its rank's
slot read from its replica on node a."""


def measure(size: str, case: str, rounds: int, profile: bool, timeout: float) -> dict[str, Any]:
    from elastictrain.checkpoint.replica_server import ReplicaServer
    from elastictrain.checkpoint.replica_wire import REPLICAS_DIR, PeerList

    shm = Path(tempfile.mkdtemp(prefix="grow-restore-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    work = Path(tempfile.mkdtemp(prefix="grow-restore-"))
    old, new = CASES[case]
    servers = {}
    try:
        nodes = {name: shm / name for name in sorted(set(old + new))}
        for name, root in nodes.items():
            root.mkdir()
            servers[name] = ReplicaServer(root, "127.0.0.1", name, f"token-{name}")
        args = {"size": size, "url": str(work / "ckpt"), "profile": profile}
        saved = _launch(work / "save", [nodes[n] for n in old], {**args, "scenario": "save"}, timeout)[0]
        for lost in set(old) - set(new):  # what the agents' ring did: the lost node's slots are replicas on a survivor
            for rank_dir in sorted(nodes[lost].glob("rank*")):
                shutil.copytree(rank_dir, nodes[new[0]] / REPLICAS_DIR / lost / rank_dir.name)
        for name in set(new):  # the agents of the new group list its nodes
            PeerList(name, [servers[n].peer() for n in sorted(set(new))]).write(nodes[name])
        trials = []
        for i in range(rounds):
            results = _launch(work / f"restore{i}", [nodes[n] for n in new], {**args, "scenario": "restore"}, timeout)
            if any(r["resumed"] != "snapshot:step-1" or r["digest"] != saved["digest"] for r in results):
                raise RuntimeError(f"round {i}: not restored as saved: {[r['resumed'] for r in results]}")
            (loaded,) = [f for name, f in results[0]["events"] if name == "checkpoint_snapshot_loaded"]
            trial = {"seconds": loaded["seconds"], **{k: loaded[k] for k in ("plan_s", "obtain_s", "load_s")},
                     "fetched_bytes": loaded["fetched_bytes"], "fetched_over_group": loaded["fetched_over_group"],
                     "fetched_in_place_bytes": loaded.get("fetched_in_place_bytes"),
                     "restore_s": [round(r["restore_s"], 3) for r in results],
                     "build_s": [round(r["build_s"], 3) for r in results],
                     "durable_load_s": max(r["durable_load_s"] for r in results)}
            if profile:
                trial["profile"] = [r["profile"] for r in results]
            trials.append(trial)
            print(f"{size} {case} round {i}: restore {trial['seconds']:.2f} s (plan {trial['plan_s']:.2f}, "
                  f"read/receive {trial['obtain_s']:.2f}, load {trial['load_s']:.2f}), "
                  f"{trial['fetched_bytes'] / 1e6:.0f} MB over the group; durable load {trial['durable_load_s']:.2f} s",
                  flush=True)
        slot = max(p.stat().st_size for p in (nodes[old[0]] / "rank0").glob("slot*.bin"))
        keys = ("seconds", "plan_s", "obtain_s", "load_s", "durable_load_s")
        return {"size": size, "case": case, "world_sizes": [len(old), len(new)], "slot_bytes": slot,
                "save_build_s": saved["build_s"], "trials": trials,
                "median": {k: round(statistics.median(t[k] for t in trials), 3) for k in keys}}
    finally:
        for server in servers.values():
            server.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,50m,150m")
    p.add_argument("--cases", default="grow,shrink", help=f"of {','.join(CASES)} (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="add each rank's cProfile of the restore")
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    p.add_argument("--out", default=str(HERE / "results" / "grow_restore.json"))
    p.add_argument("--note", default="")
    a = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": commit.strip(),
            "argv": sys.argv[1:], "note": a.note, "cpus": os.cpu_count(), "platform": platform.platform(),
            "load_before": os.getloadavg()}
    import torch

    meta["torch"] = torch.__version__
    results = [measure(size, case, a.rounds, a.profile, a.timeout) for size in a.sizes.split(",")
               for case in a.cases.split(",")]
    meta["load_after"] = os.getloadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "sizes": results}, indent=1))
    for r in results:
        print(f"{r['size']} {r['case']}: slot {r['slot_bytes'] / 1e6:.0f} MB, medians {r['median']}")


if __name__ == "__main__" and not worker_entry(_worker):
    main()
