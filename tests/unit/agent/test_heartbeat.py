"""Worker heartbeats (elastictrain/runtime/heartbeat.py) into the agent's socket (agent._HeartbeatChannel)."""

import os
import subprocess
import sys
import time

import psutil
import pytest

from elastictrain.agent.agent import _HeartbeatChannel
from elastictrain.runtime.heartbeat import ENV_AGENT_PID, ENV_HEARTBEAT_ADDR, Beat, Heartbeat


@pytest.fixture
def channel():
    ch = _HeartbeatChannel()
    yield ch
    ch.close()


def test_without_agent_env_heartbeat_is_a_noop(monkeypatch):
    monkeypatch.delenv(ENV_HEARTBEAT_ADDR, raising=False)
    monkeypatch.delenv(ENV_AGENT_PID, raising=False)
    hb = Heartbeat.from_env()
    assert not hb.enabled
    hb.beat(1, "train")


def test_beats_reach_the_agent_with_rank_pid_step_phase(channel, monkeypatch):
    monkeypatch.setenv(ENV_HEARTBEAT_ADDR, channel.addr)
    monkeypatch.setenv(ENV_AGENT_PID, str(os.getppid()))
    monkeypatch.setenv("LOCAL_RANK", "3")
    hb = Heartbeat.from_env()  # announces the worker: beat(0, "init")
    hb.beat(7, "train")
    [b0, b1] = channel.drain()
    assert (b0.local_rank, b0.pid, b0.step, b0.phase) == (3, os.getpid(), 0, "init")
    assert (b1.step, b1.phase) == (7, "train")
    assert abs(b1.time - time.monotonic()) < 1.0
    hb.close()


def test_beats_are_throttled_but_phase_changes_always_sent(channel):
    hb = Heartbeat(channel.addr, min_interval_s=10.0)
    for step in range(100):
        hb.beat(step, "train")
    hb.beat(100, "save")
    hb.beat(100, "train")
    assert [(b.step, b.phase) for b in channel.drain()] == [(0, "train"), (100, "save"), (100, "train")]


def test_unknown_phase_is_an_error(channel):
    with pytest.raises(ValueError, match="phase"):
        Heartbeat(channel.addr).beat(1, "eval")


def test_missing_agent_socket_never_raises(tmp_path):
    hb = Heartbeat(str(tmp_path / "gone.sock"), min_interval_s=0.0)
    for step in range(3):
        hb.beat(step, "train")


def test_full_agent_queue_drops_beats_without_blocking(channel):
    hb = Heartbeat(channel.addr, min_interval_s=0.0)
    t0 = time.monotonic()
    for step in range(5000):
        hb.beat(step, "train")
    assert time.monotonic() - t0 < 2.0
    assert 0 < len(channel.drain()) <= 5000


def test_beat_every_step_costs_microseconds(channel):
    hb = Heartbeat(channel.addr)
    n = 20000
    t0 = time.perf_counter()
    for step in range(n):
        hb.beat(step, "train")
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 20e-6, f"beat() took {per_call * 1e6:.1f} us per call"


def test_wire_format_roundtrip_and_garbage_rejected():
    b = Beat(local_rank=2, pid=1234, step=10**12, phase="paused", time=12.5)
    assert Beat.unpack(b.pack()) == b
    with pytest.raises(ValueError):
        Beat.unpack(b"garbage")


def _run_child(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=30)


def test_worker_whose_agent_already_died_exits_at_from_env(monkeypatch):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.delenv(ENV_HEARTBEAT_ADDR, raising=False)
    out = _run_child("from elastictrain.runtime.heartbeat import Heartbeat; Heartbeat.from_env(); print('alive')",
                     {ENV_AGENT_PID: str(dead.pid)})
    assert out.returncode == 1 and "alive" not in out.stdout


def test_worker_dies_when_its_parent_is_sigkilled(tmp_path):
    pidfile = tmp_path / "child.pid"
    child = tmp_path / "child.py"
    child.write_text(
        "import os, sys, time\n"
        "from elastictrain.runtime.heartbeat import Heartbeat\n"
        "Heartbeat.from_env()\n"
        "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n")
    # The parent plays the agent: it starts a child that ties itself to it, then waits.
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import os, subprocess, sys, time\n"
        f"env = {{**os.environ, {ENV_AGENT_PID!r}: str(os.getpid())}}\n"
        "subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]], env=env)\n"
        "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(parent), str(child), str(pidfile)])
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        worker = psutil.Process(int(pidfile.read_text()))
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:
            try:
                if worker.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.01)
        else:
            worker.kill()
            raise AssertionError("worker outlived its parent by 5 s")
    finally:
        proc.kill()
        proc.wait()
