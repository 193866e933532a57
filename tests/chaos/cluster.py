"""A multi-node `elastictrain run` job on localhost for chaos tests: agents as subprocesses, one real etcd.

Every node is an `elastictrain run` process in its own session (so a test can kill it with its workers) running
the recipe on the synthetic source (`Job`) or examples/train_mlp.py, a user's script on the public API
(`ScriptJob`); all nodes share the checkpoint directory and the output directory (the sample ledger is per rank,
summary.json is written by rank 0 of the final group).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from elastictrain.chaos.process_signals import WORKER_MODULE, kill_node, worker_pids
from elastictrain.checkpoint.discovery import list_checkpoints
from elastictrain.checkpoint.storage import open_storage
from elastictrain.runtime.audit import read_records
from elastictrain.runtime.cursor import GlobalOrder
from tests.integration.recipe_runs import FAST, REPO, run_recipe, worker_env

STEPS = 24
GLOBAL_BATCH = 8  # FAST's data.global_batch_size
HANG_FLOOR_S = 3


def expected_samples(step: int, num_samples: int = 1_000_000, seed: int = 1234,
                     global_batch: int = GLOBAL_BATCH) -> list[int]:
    """What an uninterrupted run consumes at `step` (default: the recipe's synthetic source and seed)."""
    order = GlobalOrder(num_samples, seed=seed)
    return sorted(order.lookup(range(step * global_batch, (step + 1) * global_batch)))


def spans(sizes: dict[int, int]) -> str:
    """`{0: 2, 1: 2, 2: 1}` -> "steps 0-1 on 2, step 2 on 1" (world size per run of steps), for messages."""
    runs: list[list[int]] = []  # [first step, last step, world size]
    for step in sorted(sizes):
        if runs and runs[-1][1] == step - 1 and runs[-1][2] == sizes[step]:
            runs[-1][1] = step
        else:
            runs.append([step, step, sizes[step]])
    return ", ".join(f"steps {a}-{b} on {w}" if a != b else f"step {a} on {w}" for a, b, w in runs) or "no steps"


class Node:
    """One `elastictrain run` agent process and its log."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path,
                 worker_module: str = WORKER_MODULE):
        self.name, self.log_path, self.worker_module = name, log_path, worker_module
        self._log = open(log_path, "a")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self.started = time.monotonic()

    def workers(self) -> dict[int, int]:
        return worker_pids(self.pid, self.worker_module)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the agent's process group and its workers."""
        if self.alive():
            kill_node(self.pid)
        self.proc.wait(timeout=30)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")


class Job:
    """The nodes of one run id against one etcd, a shared output and checkpoint directory."""

    worker_module = WORKER_MODULE
    """What a worker's command line holds (how `Node.workers` tells workers from other processes)."""

    def __init__(self, tmp: Path, endpoint: str, run_id: str, *, steps: int = STEPS, max_restarts: int = 10,
                 extra_overrides: tuple[str, ...] = (), nnodes: str = "1:2", ckpt_url: Optional[str] = None,
                 ckpt_view: Optional[str] = None):
        """`ckpt_url`: where the job checkpoints (default: a directory under `tmp`); `ckpt_view`: where this
        process reads those checkpoints when it cannot reach `ckpt_url` itself (e.g. the backing directory of an
        S3 server inside a network namespace)."""
        self.out, self.endpoint, self.run_id = tmp / "out", endpoint, run_id
        self.out.mkdir(parents=True, exist_ok=True)
        self.ckpt_url = ckpt_url or str(self.out / "ckpt")
        self.ckpt_view = ckpt_view or self.ckpt_url
        self.nnodes = nnodes
        self.overrides = [*FAST, f"train.output_dir={self.out}", f"checkpoint.url={self.ckpt_url}",
                          "checkpoint.every_steps=4", "checkpoint.keep_last=1000", f"train.steps={steps}",
                          "train.audit_samples=true", "train.param_digest=true", *extra_overrides]
        self.max_restarts = max_restarts
        self.nodes: list[Node] = []

    def command(self) -> list[str]:
        return [sys.executable, "-m", "elastictrain.cli.main", "run", "--config", str(REPO / "configs/tiny-cpu.yaml"),
                *self.agent_args()]

    def agent_args(self) -> list[str]:
        """The overrides as `--set`s, then the agent's flags."""
        return [*(x for o in self.overrides for x in ("--set", o)), "--nnodes", self.nnodes, "--nproc-per-node", "1",
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id, "--max-restarts", str(self.max_restarts),
                "--heartbeat-timeout", str(HANG_FLOOR_S)]

    def start_node(self, name: str, env: Optional[dict[str, str]] = None, prefix: Sequence[str] = (),
                   args: Sequence[str] = ()) -> Node:
        """Start (or re-join: the same command again) one node; `prefix` wraps the command (`ip netns exec NS`),
        `args` are extra agent flags of this node (`--local-addr`)."""
        cmd = [*prefix, *self.command(), *args]
        node = Node(name, cmd, {**worker_env(), **(env or {})}, self.out / f"agent-{name}.log", self.worker_module)
        self.nodes.append(node)
        return node

    def logs(self) -> str:
        return "\n".join(f"===== {n.name} (pid {n.pid}, rc {n.proc.poll()})\n{n.log()[-6000:]}" for n in self.nodes)

    def records(self) -> list[dict]:
        d = self.out / "samples"
        return read_records(d) if d.exists() else []

    def max_step(self) -> int:
        return max((r["step"] for r in self.records()), default=-1)

    def wait_for_step(self, step: int, timeout: float = 240, world_size: Optional[int] = None,
                      after_seq: int = -1) -> dict:
        """Wait until a ledger record of `step` (or later) exists, optionally from a group of `world_size`
        launched after `after_seq`; returns that record."""
        deadline = time.monotonic() + timeout
        while True:
            for r in self.records():
                if (r["step"] >= step and r["seq"] > after_seq
                        and (world_size is None or r["world_size"] == world_size)):
                    return r
            assert any(n.alive() for n in self.nodes), f"every node exited before step {step}\n{self.logs()}"
            if time.monotonic() >= deadline:
                self.dump_stacks()  # where the stuck workers wait, in the logs below
                raise AssertionError(f"no step {step} within {timeout}s\n{self.logs()}")
            time.sleep(0.05)

    def wait_workers(self, node: Node, timeout: float = 120) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while not (pids := node.workers()):
            assert node.alive() and time.monotonic() < deadline, f"{node.name} has no workers\n{self.logs()}"
            time.sleep(0.05)
        return pids

    def wait(self, nodes: list[Node], timeout: float = 300) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for n in nodes:
            try:
                codes.append(n.proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{n.name} did not finish within {timeout}s\n{self.logs()}") from None
        return codes

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def valid_checkpoints(self) -> set[int]:
        return {c.step for c in list_checkpoints(open_storage(self.ckpt_view)) if c.valid}

    def checkpoint_world_sizes(self) -> dict[int, int]:
        """step -> the world size each valid checkpoint was written at (from its manifest)."""
        return {c.step: c.manifest.metadata.world_size for c in list_checkpoints(open_storage(self.ckpt_view))
                if c.valid and c.manifest is not None}

    def committed(self) -> dict[int, dict]:
        """step -> {"world_size", "samples"} from the newest launch that ran it (the history the model saw)."""
        newest: dict[int, tuple] = {}
        for r in self.records():
            key = (r["seq"], r["launch"])
            cur = newest.get(r["step"])
            if cur is None or key > cur[0]:
                newest[r["step"]] = (key, r["world_size"], list(r["samples"]))
            elif key == cur[0]:
                cur[2].extend(r["samples"])
        return {s: {"world_size": ws, "samples": sorted(samples)} for s, (_, ws, samples) in newest.items()}

    def assert_world_sizes(self, expected: dict[int, int]) -> None:
        """Every committed step ran at its expected world size (sample ledger), and every valid checkpoint was
        written at the world size of the step before it (its manifest): two records that must agree."""
        ran = {s: c["world_size"] for s, c in self.committed().items()}
        assert ran == expected, f"committed history: {spans(ran)}; expected: {spans(expected)}"
        written = self.checkpoint_world_sizes()
        assert written, "no valid checkpoint to check"
        wanted = {s: expected[s - 1] for s in written if s > 0}
        assert {s: w for s, w in written.items() if s > 0} == wanted, \
            f"checkpoints written at world sizes {sorted(written.items())}, expected {sorted(wanted.items())}"

    def dump_stacks(self) -> None:
        """Every live worker writes its threads' Python stacks into its node's log (SIGUSR2, runtime/worker.py): for
        a test that gives up on a stuck job, before it reads the logs."""
        for n in self.nodes:
            if n.alive():
                for pid in n.workers().values():
                    try:
                        os.kill(pid, signal.SIGUSR2)
                    except ProcessLookupError:
                        continue
        time.sleep(1.0)

    def teardown(self) -> None:
        for n in self.nodes:
            if n.alive():
                n.kill()

    def run_uninterrupted(self, nproc: int) -> dict:
        """The same job as one plain torchrun run of `nproc` ranks from its first step to its last, writing into
        this job's output and checkpoint directories; returns its summary. A reference for the elastic runs, which
        must reach its state bitwise: nothing to recover from, so no agent, etcd or spare worker to pay for."""
        return run_recipe(self.out, nproc, self.overrides, timeout=600)


class ScriptJob(Job):
    """The same job running examples/train_mlp.py (a user's script on the public API) instead of the recipe.

    `extra_overrides` are the agents' `elastic.*` settings; the script checkpoints every `every` steps into the
    job's checkpoint directory, keeps the sample ledger in `out/samples`, and its rank 0 writes summary.json
    (step, world_size, model and optim digests) when it leaves its loop."""

    worker_module = "train_mlp.py"
    num_samples = 4096  # the script's dataset
    global_batch = 32  # its default --global-batch

    def __init__(self, tmp: Path, endpoint: str, run_id: str, *, steps: int = STEPS, every: int = 4,
                 extra_overrides: tuple[str, ...] = (), **kwargs):
        super().__init__(tmp, endpoint, run_id, steps=steps, extra_overrides=extra_overrides, **kwargs)
        self.overrides = list(extra_overrides)
        self.script = [str(REPO / "examples/train_mlp.py"), "--steps", str(steps), "--checkpoint", self.ckpt_url,
                       "--every", str(every), "--audit-dir", str(self.out / "samples"),
                       "--out", str(self.out / "summary.json")]

    def command(self) -> list[str]:
        return [sys.executable, "-m", "elastictrain.cli.main", "run", *self.agent_args(), *self.script]

    def expected_samples(self, step: int) -> list[int]:
        """What an uninterrupted run consumes at `step` (the script's sampler: seed 0)."""
        return expected_samples(step, self.num_samples, seed=0, global_batch=self.global_batch)

    def uninterrupted_command(self, nproc: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                f"--log-dir={self.out / 'torchelastic'}", *self.script]

    def run_uninterrupted(self, nproc: int) -> dict:
        """The script under plain torchrun, `nproc` ranks, to its end (see `Job.run_uninterrupted`); rank 0's
        summary."""
        r = subprocess.run(self.uninterrupted_command(nproc), cwd=REPO, env=worker_env(), capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-4000:]}"
        return self.summary()

    def start_uninterrupted(self, nproc: int) -> subprocess.Popen:
        """`run_uninterrupted` in the background (its own session; output in `uninterrupted_log()`): a reference
        that runs while a chaos job waits; `finish_uninterrupted` waits for its exit code."""
        log = open(self.out / "uninterrupted.log", "w")
        try:
            return subprocess.Popen(self.uninterrupted_command(nproc), cwd=REPO, env=worker_env(), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def finish_uninterrupted(self, proc: subprocess.Popen, timeout: float = 600) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the uninterrupted run did not finish within {timeout}s") from None

    def stop_uninterrupted(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            kill_node(proc.pid)  # SIGKILL its process group (torchrun and its ranks)
        proc.wait(timeout=30)

    def uninterrupted_log(self) -> str:
        return (self.out / "uninterrupted.log").read_text(errors="replace")


@dataclass
class Reference:
    """An uninterrupted 2-rank run: its summary and its checkpoints (every 4 steps, all kept)."""

    summary: dict
    ckpt_url: str

    def checkpoint(self, step: int) -> str:
        found = [c.url for c in list_checkpoints(open_storage(self.ckpt_url)) if c.valid and c.step == step]
        assert found, f"the reference has no checkpoint of step {step}"
        return found[0]
