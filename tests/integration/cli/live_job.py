"""A real 2-node job for the operator CLI tests: `elastictrain run` agents on one etcd, and CLI calls against it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

from tests.integration.recipe_runs import FAST, REPO, worker_env


class LiveJob:
    """Agents started in their own sessions; `stop()` signals each agent's process group by PID."""

    def __init__(self, endpoint: str, run_id: str, out: Path, steps: int, extra: Optional[list[str]] = None,
                 overrides: Optional[list[str]] = None, env: Optional[dict[str, str]] = None):
        """`env`: added to every agent's environment (and its workers')."""
        self.endpoint, self.run_id, self.out, self.steps = endpoint, run_id, out, steps
        self.env = env or {}
        self.extra, self.overrides = extra or [], overrides or []
        self.agents: list[subprocess.Popen] = []
        self.ckpt = out / "ckpt"

    def start_agent(self, *flags: str) -> subprocess.Popen:
        overrides = [*FAST, f"train.steps={self.steps}", f"train.output_dir={self.out}",
                     f"checkpoint.url={self.ckpt}", "checkpoint.every_steps=10", "train.log_every=10", *self.overrides]
        cmd = [sys.executable, "-m", "elastictrain.cli.main", "run", "--config", str(REPO / "configs/tiny-cpu.yaml"),
               "--nnodes=1:2", "--nproc-per-node=1", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
               "--max-restarts=3", "--rdzv-conf=lease_ttl=3,last_call_timeout=2,join_timeout=120",
               *self.extra, *flags]
        for o in overrides:
            cmd += ["--set", o]
        self.out.mkdir(parents=True, exist_ok=True)
        log = open(self.out / f"agent{len(self.agents)}.log", "w")
        env = {**worker_env(), **self.env}
        env["ELASTICTRAIN_LOG_LEVEL"] = "INFO"
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.agents.append(p)
        return p

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        """The CLI in this process (a fresh `elastictrain` process spends seconds importing torch)."""
        from elastictrain.cli.main import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([*args, "--endpoint", self.endpoint, "--run-id", self.run_id])
        return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())

    def cli_process(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """The installed entry point, as an operator runs it."""
        cmd = [sys.executable, "-m", "elastictrain.cli.main", *args, "--endpoint", self.endpoint,
               "--run-id", self.run_id]
        return subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=timeout)

    def status(self) -> dict[str, Any]:
        r = self.cli("status", "--json")
        assert r.returncode in (0, 1), r.stderr
        return json.loads(r.stdout)

    def wait_status(self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            r = self.cli("status", "--json")
            if r.returncode == 2 and "no run" in r.stderr:  # no agent has written anything yet
                time.sleep(0.5)
                continue
            assert r.returncode in (0, 1), r.stderr
            last = json.loads(r.stdout)
            if pred(last):
                return last
            self.check_alive()
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}; last status: {json.dumps(last)[:3000]}\n{self.logs()}")

    def check_alive(self) -> None:
        dead = [p for p in self.agents if p.poll() is not None and p.returncode != 0]
        if dead:
            raise AssertionError(f"agent exited {dead[0].returncode}\n{self.logs()}")

    def worker_pids(self, agent: subprocess.Popen) -> list[int]:
        out = []
        for c in psutil.Process(agent.pid).children(recursive=True):
            try:
                if "elastictrain.recipes.lm" in " ".join(c.cmdline()):
                    out.append(c.pid)
            except psutil.NoSuchProcess:
                continue
        return out

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-tail:]}" for p in sorted(self.out.glob("agent*.log")))

    def wait_exit(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        for p in self.agents:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        return [p.returncode for p in self.agents]

    def stop(self) -> None:
        for p in self.agents:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
