"""Runtime overhead: a user script on the public API vs the same training loop written by hand, same run.

    python benchmarks/overhead.py [--nproc 2] [--rounds 7] [--sizes tiny_lm,lm,mlp] [--steps-per-round N]

For each model size the worker processes (torchrun, gloo, loopback) hold two copies of one model, built from the
same seed, sharded with `fully_shard`, each with AdamW and an LR scheduler:

* hand: a plain FSDP2 loop: this rank's contiguous share of a shuffled global batch, micro-batch accumulation with
  `set_requires_gradient_sync`, optimizer and scheduler step, and the loss summed over ranks with an
  `all_reduce` + `.item()` every step, as a user logs it;
* api: the same step on the public API: `for step in w.steps(...)` over a `TrainState`, `ElasticSampler`
  micro-batches, `w.report(loss=...)`. Heartbeats are really sent: `ELASTICTRAIN_HEARTBEAT_ADDR` names a unix
  datagram socket that a thread of this process drains, as under our agent. No checkpoint (saves are
  benchmarks/checkpoint.py's).

Both run the same number of micro-batches of the same size per rank. Within a round they take turns step by step
(which goes first alternates between rounds), so machine noise hits both alike; a round gives each loop's median
step time, and the figure per size is the ratio of the medians over rounds, api / hand (target <= 1.03). The same
is computed from the process's CPU time per step (the work done, less sensitive to other processes' load).
Per-round ratios and where the API's step boundary spends its time (the end of a step: sampler advance, the flags +
metrics all_reduce, heartbeat; and the sampler's planning) are in benchmarks/results/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

HERE = Path(__file__).resolve().parent
TARGET_RATIO = 1.03


@dataclass(frozen=True)
class Size:
    """One model size: the model, its batch shape, and how many steps a round times."""

    kind: str
    """"lm" (a transformers Llama from its config) or "mlp" (examples/train_mlp.py's model)."""
    model: dict[str, int]
    global_batch: int
    micro_batch: int
    steps_per_round: int
    seq_len: int = 0


SIZES = {
    # The model of the previous version of this benchmark (configs/tiny-cpu.yaml with these overrides).
    "tiny_lm": Size("lm", {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256},
                    global_batch=16, micro_batch=4, steps_per_round=5, seq_len=128),
    # ~6x the tiny one's parameters; half its batch, so that a round stays short on a loaded 2-core machine.
    "lm": Size("lm", {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 6,
                      "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 256},
               global_batch=8, micro_batch=2, steps_per_round=3, seq_len=128),
    # examples/train_mlp.py's model and batch: a step of milliseconds, where a fixed cost per step shows most.
    "mlp": Size("mlp", {"dim": 64, "hidden": 256}, global_batch=32, micro_batch=8, steps_per_round=40),
}


# --- the parent: launches the workers, drains their heartbeats, writes the result -----------------------------


class HeartbeatSink:
    """A unix datagram socket that a thread drains, counting beats: what our agent gives its workers."""

    def __init__(self, path: Path):
        from elastictrain.runtime.heartbeat import MAX_DATAGRAM_BYTES

        self.path, self.beats, self.other = path, 0, 0
        self._size = MAX_DATAGRAM_BYTES
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="heartbeat-sink", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        from elastictrain.runtime.heartbeat import Beat, decode

        while not self._stop.is_set():
            try:
                data = self._sock.recv(self._size)
            except TimeoutError:
                continue
            if isinstance(decode(data), Beat):
                self.beats += 1
            else:
                self.other += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sizes", default="tiny_lm,lm,mlp", help=f"comma-separated, of: {', '.join(SIZES)}")
    p.add_argument("--steps-per-round", type=int, default=0, help="override every size's default (0: keep them)")
    p.add_argument("--out", default=str(HERE / "results/overhead.json"))
    args = p.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    unknown = set(args.sizes.split(",")) - set(SIZES)
    if unknown:
        p.error(f"--sizes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SIZES)}")
    started, load_before = time.monotonic(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="et-overhead-") as tmp:  # 0700, as the agent's socket directory
        sink = HeartbeatSink(Path(tmp) / "hb.sock")
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   ELASTICTRAIN_HEARTBEAT_ADDR=str(sink.path), ELASTICTRAIN_CONTROL_FILE=str(Path(tmp) / "control"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               f"--log-dir={Path(tmp) / 'torchelastic'}", __file__, "--rounds", str(args.rounds), "--sizes", args.sizes,
               "--steps-per-round", str(args.steps_per_round), "--out", args.out]
        try:
            subprocess.run(cmd, env=env, check=True)
        finally:
            sink.close()
    res = json.loads(Path(args.out).read_text())
    res.update(heartbeats_received=sink.beats, loadavg_before=[round(x, 2) for x in load_before],
               loadavg_after=[round(x, 2) for x in os.getloadavg()], bench_wall_s=round(time.monotonic() - started, 1),
               command=shlex.join(["python", os.path.relpath(__file__), *sys.argv[1:]]))
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    for name, r in res["sizes"].items():
        med, spread = r["median_step_s"], r["per_round_ratio"]
        sys.stdout.write(f"{name}: api/hand {r['ratio_api_over_hand']:.4f} (api {med['api'] * 1e3:.1f} ms, hand "
                         f"{med['hand'] * 1e3:.1f} ms; per round {spread['min']:.3f}..{spread['max']:.3f})\n")
    sys.stdout.write(f"heartbeats received: {sink.beats} -> {args.out}\n")


# --- the workers ---------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One copy of the model with its optimizer, and how to get a micro-batch's mean loss."""

    model: Any
    optim: Any
    sched: Any
    num_samples: int
    loss: Callable[[list[int]], Any]
    params: int


class TimedLoop(Protocol):
    name: str
    boundary: dict[str, list[float]]

    def step(self) -> None: ...


def build_job(size: Size, mesh: Any, total_steps: int) -> Job:
    """The same initial weights on every rank and for both loops (seeded here)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    if size.kind == "lm":
        from transformers import AutoConfig, AutoModelForCausalLM

        from elastictrain.runtime.data import SyntheticSource

        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **size.model),
                                                 attn_implementation="sdpa")
        blocks = list(model.model.layers)
        source = SyntheticSource(100_000, size.seq_len, size.model["vocab_size"], seed=0)

        def loss(indices: list[int]) -> Any:
            tokens = source.batch(indices)
            logits = model(input_ids=tokens[:, :-1]).logits
            return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        num_samples = source.num_samples
    else:
        dim, hidden = size.model["dim"], size.model["hidden"]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, dim, generator=g)
        y = (x @ torch.randn(dim, 1, generator=g)).tanh() + 0.1 * torch.randn(4096, 1, generator=g)
        model = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden),
                                    torch.nn.GELU(), torch.nn.Linear(hidden, 1))
        blocks = list(model[::2])

        def loss(indices: list[int]) -> Any:
            return F.mse_loss(model(x[indices]), y[indices])
        num_samples = len(x)
    params = sum(p.numel() for p in model.parameters())
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=total_steps)
    return Job(model, optim, sched, num_samples, loss, params)


@dataclass
class HandLoop:
    """The hand-written loop: what a user writes around fully_shard without elastictrain."""

    job: Job
    size: Size
    rank: int
    world_size: int
    name: str = "hand"
    step_index: int = 0
    boundary: dict[str, list[float]] = field(default_factory=lambda: {"log_all_reduce": []})

    def __post_init__(self) -> None:
        import torch

        # A DistributedSampler-like shuffled order; this rank takes a contiguous share of each global batch.
        self.order = torch.randperm(self.job.num_samples, generator=torch.Generator().manual_seed(0)).tolist()
        self.per_rank = self.size.global_batch // self.world_size
        self.accum = self.per_rank // self.size.micro_batch

    def step(self) -> None:
        import torch
        import torch.distributed as dist

        j, m = self.job, self.size.micro_batch
        start = self.step_index * self.size.global_batch + self.rank * self.per_rank
        logged = torch.zeros((), dtype=torch.float64)
        for i in range(self.accum):
            j.model.set_requires_gradient_sync(i == self.accum - 1)
            loss = j.loss([self.order[(start + i * m + k) % j.num_samples] for k in range(m)])
            (loss / self.accum).backward()
            logged += loss.detach() / (self.accum * self.world_size)
        j.optim.step()
        j.sched.step()
        j.optim.zero_grad(set_to_none=True)
        t = time.perf_counter()
        dist.all_reduce(logged)
        self.last_loss = logged.item()
        self.boundary["log_all_reduce"].append(time.perf_counter() - t)
        self.step_index += 1


class ApiLoop:
    """The same step on the public API: `for step in w.steps(...)`, driven one step at a time (`next` is what the
    for statement calls) so that rounds of the hand loop can run in between."""

    name = "api"

    def __init__(self, w: Any, job: Job, size: Size, total_steps: int):
        import elastictrain as et

        self.w, self.job = w, job
        self.sampler = et.ElasticSampler(job.num_samples, global_batch_size=size.global_batch,
                                         micro_batch_size=size.micro_batch, seed=0)
        if self.sampler.micro_batches_per_step % w.world_size:
            raise SystemExit(f"{size}: the global batch must split into whole micro-batches per rank, so that both "
                             f"loops compute the same (no padding micro-batches)")
        state = et.TrainState(model=job.model, optim=job.optim, scheduler=job.sched, data=self.sampler)
        self._steps = iter(w.steps(total_steps, state))
        self.boundary: dict[str, list[float]] = {"end_of_step": [], "plan": []}

    def step(self) -> None:
        j, t0 = self.job, time.perf_counter()
        next(self._steps)  # ends the previous step (sampler advance, all_reduce, heartbeat), starts this one
        t1 = time.perf_counter()
        micro_batches = self.sampler.micro_batches()
        self.boundary["end_of_step"].append(t1 - t0)
        self.boundary["plan"].append(time.perf_counter() - t1)
        for mb in micro_batches:
            j.model.set_requires_gradient_sync(mb.last)
            loss = j.loss(mb.indices)
            (loss * mb.weight).backward()
            self.w.report(loss=loss.detach() * mb.fraction)
        j.optim.step()
        j.sched.step()
        j.optim.zero_grad()

    def finish(self) -> None:
        if next(self._steps, None) is not None:
            raise RuntimeError("the step loop has steps left after the last round")


def time_step(loop: TimedLoop) -> tuple[float, float]:
    """One step of `loop`: (wall seconds, this process's CPU seconds, all threads)."""
    import torch.distributed as dist

    dist.barrier()  # every step starts with the ranks aligned, in both loops
    t, c = time.perf_counter(), time.process_time()
    loop.step()
    # Until every rank is done: the hand loop's last collective (its loss all_reduce) ends its step, the API
    # loop's runs when the next step starts; without this, rank 0 would time its wait for a slower rank in the
    # hand loop only.
    dist.barrier()
    return time.perf_counter() - t, time.process_time() - c


def measure_size(w: Any, size: Size, rounds: int, steps_per_round: int) -> dict[str, Any]:
    """Both loops on this size, in rounds; rank 0's step times.

    Within a round the loops take turns step by step (which one goes first alternates between rounds), so that a
    change of the machine's load between two steps hits both alike.
    """
    import gc

    n = steps_per_round or size.steps_per_round
    warmup = max(2, n // 3)
    total = warmup + rounds * n
    hand = HandLoop(build_job(size, w.mesh, total), size, w.rank, w.world_size)
    api = ApiLoop(w, build_job(size, w.mesh, total), size, total)
    for loop in (hand, api):
        for _ in range(warmup):
            time_step(loop)
        for times in loop.boundary.values():
            times.clear()
    per_round = []
    for r in range(rounds):
        order: tuple[TimedLoop, TimedLoop] = (hand, api) if r % 2 == 0 else (api, hand)
        wall: dict[str, list[float]] = {"hand": [], "api": []}
        cpu: dict[str, list[float]] = {"hand": [], "api": []}
        for _ in range(n):
            for loop in order:
                dt, dc = time_step(loop)
                wall[loop.name].append(dt)
                cpu[loop.name].append(dc)
        med = {k: statistics.median(v) for k, v in wall.items()}
        med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        per_round.append({"first": order[0].name, "hand_s": med["hand"], "api_s": med["api"],
                          "ratio": med["api"] / med["hand"], "hand_cpu_s": med_cpu["hand"],
                          "api_cpu_s": med_cpu["api"], "cpu_ratio": med_cpu["api"] / med_cpu["hand"]})
        if w.is_main:
            sys.stderr.write(f"{size.kind} {size.model}: round {r + 1}/{rounds} hand {med['hand']:.4f}s "
                             f"api {med['api']:.4f}s ratio {med['api'] / med['hand']:.4f} "
                             f"(cpu {med_cpu['api'] / med_cpu['hand']:.4f}), load {os.getloadavg()[0]:.1f}\n")
    api.finish()
    result = summarize(per_round)
    result.update(
        model={"kind": size.kind, **size.model, **({"seq_len": size.seq_len} if size.seq_len else {})},
        params=hand.job.params, global_batch_size=size.global_batch, micro_batch_size=size.micro_batch,
        micro_batches_per_rank=hand.accum, warmup_steps=warmup, steps_per_round=n,
        boundary_median_ms={f"{loop.name}.{k}": round(statistics.median(v) * 1e3, 3)
                            for loop in (hand, api) for k, v in loop.boundary.items()},
        loss_last={"hand": hand.last_loss, "api": w.metrics.get("loss")})
    del hand, api
    gc.collect()
    return result


def summarize(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """The ratio of the medians over rounds, and the spread of the per-round ratios (wall clock; CPU if measured)."""
    hand = statistics.median(r["hand_s"] for r in per_round)
    api = statistics.median(r["api_s"] for r in per_round)
    ratios = [r["ratio"] for r in per_round]
    out = {"median_step_s": {"hand": hand, "api": api}, "ratio_api_over_hand": api / hand,
           "per_round_ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
           "meets_target": api / hand <= TARGET_RATIO}
    if all("hand_cpu_s" in r for r in per_round):
        # CPU seconds of the process per step: the work each loop does, much less sensitive to other processes'
        # load than wall time (which includes waiting for a core).
        hand_cpu = statistics.median(r["hand_cpu_s"] for r in per_round)
        api_cpu = statistics.median(r["api_cpu_s"] for r in per_round)
        cpu_ratios = [r["cpu_ratio"] for r in per_round]
        out.update(median_step_cpu_s={"hand": hand_cpu, "api": api_cpu}, cpu_ratio_api_over_hand=api_cpu / hand_cpu,
                   per_round_cpu_ratio={"median": statistics.median(cpu_ratios), "min": min(cpu_ratios),
                                        "max": max(cpu_ratios)})
    return {**out, "rounds": per_round}


def worker(args: argparse.Namespace) -> None:
    import torch

    import elastictrain as et

    with et.Worker(seed=0) as w:
        sizes = {name: measure_size(w, SIZES[name], args.rounds, args.steps_per_round)
                 for name in args.sizes.split(",")}
        if w.is_main:
            out = {
                "benchmark": "runtime overhead: a user script on the public API vs the same FSDP2 loop by hand",
                "world_size": w.world_size, "backend": "gloo", "rounds": args.rounds,
                "target_ratio_max": TARGET_RATIO, "sizes": sizes,
                "machine": {"arch": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                            "python": platform.python_version(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
