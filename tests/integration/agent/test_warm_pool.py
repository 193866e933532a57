"""Pre-warmed spare workers (agent/warm.py + runtime/warmstart.py) as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from elastictrain.agent.warm import WarmPool
from elastictrain.runtime.warmstart import assigned_rank, idle_spares

pytestmark = pytest.mark.timeout(120)

MODULE = "tests.integration.agent.warm_worker"
REPO = Path(__file__).resolve().parents[3]


def _wait(pred, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the spares import the worker module from the repo root, as `python -m` would


def test_a_spare_imports_ahead_then_runs_the_worker_as_assigned(tmp_path, in_repo):
    args = ("-u", "-m", MODULE, str(tmp_path))
    pool = WarmPool(sys.executable, args, size=1)
    try:
        assert pool.fill() == 1
        assert _wait(lambda: pool.ready() == 1), "the spare never finished pre-importing the worker module"
        assert list(tmp_path.glob("prewarmed-*"))
        assert idle_spares(os.getpid()) == (1, 1)
        handler = pool.serve(0, args, {"RANK": "7"}, str(tmp_path / "out.log"), None)
        assert handler is not None
        assert assigned_rank(handler.proc.pid, psutil.Process(handler.proc.pid).environ()) == 7
        assert handler.proc.wait(timeout=60) == 0
        ran = json.loads((tmp_path / f"ran-{handler.proc.pid}.json").read_text())
        assert ran == {"rank": "7", "argv": [str(tmp_path)], "name": "__main__", "prewarmed": True}
        assert (tmp_path / "out.log").read_text() == "worker 7 says hello\n"
        assert idle_spares(os.getpid()) == (0, 0)
        assert pool.served == 1 and pool.serve(0, args, {"RANK": "0"}, None, None) is None  # empty: start cold
    finally:
        pool.close()


def test_the_worker_exit_code_reaches_the_agent(tmp_path, in_repo):
    args = ("-m", MODULE, str(tmp_path), "3")
    pool = WarmPool(sys.executable, args, size=1)
    try:
        pool.fill()
        handler = pool.serve(0, args, {"RANK": "0"}, None, None)
        assert handler is not None and handler.proc.wait(timeout=60) == 3
    finally:
        pool.close()


def test_a_spare_runs_the_assigned_arguments_not_the_ones_it_started_with(tmp_path, in_repo):
    pool = WarmPool(sys.executable, ("-m", MODULE, str(tmp_path)), size=1)
    try:
        pool.fill()
        handler = pool.serve(0, ("-m", MODULE, str(tmp_path), "4"), {"RANK": "1"}, None, None)
        assert handler is not None and handler.proc.wait(timeout=60) == 4
        ran = json.loads((tmp_path / f"ran-{handler.proc.pid}.json").read_text())
        assert ran["argv"] == [str(tmp_path), "4"] and ran["rank"] == "1"
    finally:
        pool.close()


def test_idle_spares_exit_when_the_pool_closes(tmp_path, in_repo):
    pool = WarmPool(sys.executable, ("-m", MODULE, str(tmp_path)), size=2)
    pool.fill()
    procs = [psutil.Process(s.proc.pid) for s in pool._spares]
    pool.close()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
    assert not os.path.exists(pool.dir)


def test_spares_never_outlive_their_agent(tmp_path, in_repo):
    agent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from elastictrain.agent.warm import WarmPool
        pool = WarmPool(sys.executable, ("-m", "{MODULE}", {str(tmp_path)!r}), size=2)
        pool.fill()
        print(" ".join(str(s.proc.pid) for s in pool._spares), flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        pids = [int(p) for p in agent.stdout.readline().split()]
        assert len(pids) == 2
        assert _wait(lambda: len(list(tmp_path.glob("prewarmed-*"))) == 2)
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=30)
        assert _wait(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                     for p in pids), timeout=20), "spares outlived a SIGKILLed agent"
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
