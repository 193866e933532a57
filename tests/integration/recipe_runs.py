"""Launching the training recipe under real torchrun, for integration tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]

# A small, fast job: tiny Llama on the synthetic source.
FAST = [
    "model.overrides.hidden_size=32", "model.overrides.intermediate_size=64",
    "model.overrides.num_attention_heads=2", "model.overrides.num_key_value_heads=2",
    "data.source=synthetic", "data.path=null", "data.seq_len=16", "data.global_batch_size=8", "data.micro_batch_size=2",
    "optim.warmup_steps=2", "train.log_every=5", "checkpoint.url=null", "checkpoint.every_steps=0",
]


def torchrun_cmd(nproc: int, overrides: list[str], extra_torchrun: Optional[list[str]] = None,
                 log_dir: Optional[Path] = None) -> list[str]:
    """Stock torchrun running the recipe. `log_dir`: torch's log folder (its workers' error files); without one
    torch makes a `torchelastic_*` folder in the temp directory and never removes it (one per run of the suite's
    baselines), so pass one inside the test's own directory."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *([f"--log-dir={log_dir}"] if log_dir is not None else []), *(extra_torchrun or []),
           "-m", "elastictrain.recipes.lm", "--config", str(REPO / "configs/tiny-cpu.yaml")]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", AWS_EC2_METADATA_DISABLED="true")
    return env


def run_nodes(cmd: list[str], nodes: int, cwd: Path, env: dict[str, str],
              timeout: float = 240) -> tuple[list[int], str]:
    """Run `nodes` copies of one `elastictrain run` command (the nodes of a job on localhost) to their end; their
    exit codes and their logs, one after another."""
    procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(nodes)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], "\n".join(logs)


def run_recipe(out: Path, nproc: int, overrides: list[str], timeout: float = 300,
               extra_torchrun: Optional[list[str]] = None) -> dict:
    """Run to completion; return the summary written by rank 0."""
    cmd = torchrun_cmd(nproc, [*FAST, f"train.output_dir={out}", *overrides], extra_torchrun, out / "torchelastic")
    r = subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-4000:]}"
    return json.loads((out / "summary.json").read_text())


def start_recipe(out: Path, nproc: int, overrides: list[str],
                 extra_torchrun: Optional[list[str]] = None) -> subprocess.Popen:
    """Start a run in the background (its own session, so a test can signal the whole tree)."""
    cmd = torchrun_cmd(nproc, [*FAST, f"train.output_dir={out}", *overrides], extra_torchrun, out / "torchelastic")
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "launcher.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=worker_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the recipe workers below a launcher process."""
    import psutil

    out = {}
    for p in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if "elastictrain.recipes.lm" in " ".join(p.cmdline()):
                out[int(p.environ()["RANK"])] = p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
            continue
    return out


def ledger_max_step(out: Path) -> int:
    from elastictrain.runtime.audit import read_records

    recs = read_records(out / "samples") if (out / "samples").exists() else []
    return max((r["step"] for r in recs), default=-1)


def assert_same_train_state(run: dict, reference: dict) -> None:
    """Two summaries hold bitwise the same final parameters and optimizer state, and the same loss at every step
    `run` logged. A summary without digests (train.param_digest off) fails: "" == "" proves nothing."""
    for key in ("param_digest", "optim_digest"):
        assert reference[key] and run[key], f"a summary has no {key}: set train.param_digest=true"
        assert run[key] == reference[key], f"{key} differs from the reference's"
    for step, loss in run["losses"].items():
        ref = reference["losses"][step]
        assert loss == ref, f"loss at step {step}: {loss!r}, reference {ref!r}"
