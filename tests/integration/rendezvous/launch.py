"""Start plain `torchrun` agents running worker.py, kill them like a lost node, and read their progress.

Shared by the torchrun integration tests and benchmarks/rendezvous.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

WORKER = Path(__file__).with_name("worker.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


@dataclass
class Step:
    """One logged step of one worker."""

    time: float
    step: int
    rank: int
    world: int
    restart: int
    tag: str


@dataclass
class Agent:
    """One torchrun agent (a simulated node) and its worker processes."""

    tag: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    extra_pids: list[int] = field(default_factory=list)

    def descendants(self) -> list[int]:
        """PIDs of the agent's worker processes (and their children)."""
        try:
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill_node(self) -> float:
        """SIGKILL the agent and its workers by PID, as a power loss would; return the time of the kill."""
        pids = [self.proc.pid, *self.descendants()]
        killed_at = time.time()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)
        _reap(pids[1:])
        return killed_at

    def kill_agent_only(self) -> tuple[float, list[int]]:
        """SIGKILL only the agent; its workers (own session) live on. Return the kill time and their PIDs."""
        workers = self.descendants()
        killed_at = time.time()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.extra_pids.extend(workers)
        return killed_at, workers

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM the agent (it stops its workers), then SIGKILL whatever is left, by PID."""
        pids = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _reap([*pids, *self.extra_pids])

    def output(self) -> str:
        """The agent's stdout+stderr so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_agent(
    tag: str,
    workdir: Path,
    rdzv_args: list[str],
    nproc: int = 1,
    nnodes: str = "1:3",
    max_restarts: int = 5,
    env: dict[str, str] | None = None,
    prefix: list[str] | None = None,
) -> Agent:
    """Start `torchrun ... worker.py` for one node; progress goes to `workdir/progress`."""
    progress = workdir / "progress"
    progress.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"agent-{tag}-{time.monotonic_ns()}.log"
    full_env = {
        **os.environ,
        "PROGRESS_DIR": str(progress),
        "NODE_TAG": tag,
        "STEP_SECONDS": "0.1",
        "PG_TIMEOUT": "20",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    cmd = [
        *(prefix or []),
        TORCHRUN,
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        f"--log-dir={workdir / 'torchelastic'}",  # not a torchelastic_* folder left in the temp directory
        *rdzv_args,
        str(WORKER),
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    return Agent(tag, proc, log_path)


def etcd3_args(endpoint: str, run_id: str, **conf: object) -> list[str]:
    """`--rdzv-*` arguments for the etcd3 backend (tuned for tests: short lease and last call)."""
    conf = {"lease_ttl": 2, "last_call_timeout": 1, **conf}
    conf_str = ",".join(f"{k}={v}" for k, v in conf.items())
    return ["--rdzv-backend=etcd3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", f"--rdzv-conf={conf_str}"]


def read_steps(workdir: Path) -> list[Step]:
    """All logged steps of all workers, in time order."""
    steps: list[Step] = []
    for path in (workdir / "progress").glob("*.log"):
        tag = path.stem.rsplit("-", 1)[0]
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 6:
                steps.append(Step(float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), int(parts[5]), tag))
    return sorted(steps, key=lambda s: s.time)


def wait_for(workdir: Path, predicate, timeout: float, agents: list[Agent] | None = None) -> list[Step]:
    """Poll the progress logs until `predicate(steps)` is true; fail with the agents' output if not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = read_steps(workdir)
        if predicate(steps):
            return steps
        time.sleep(0.1)
    tails = "\n".join(f"--- agent {a.tag}:\n{a.output()[-3000:]}" for a in agents or [])
    raise AssertionError(f"progress condition not met within {timeout} s\n{tails}")
