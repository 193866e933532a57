"""Worker heartbeats and events (runtime/heartbeat.py) into the agent's socket (agent._HeartbeatChannel)."""

import logging
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from elastictrain.agent.agent import ElasticAgent, _HeartbeatChannel
from elastictrain.runtime.heartbeat import (
    ENV_AGENT_PID,
    ENV_HEARTBEAT_ADDR,
    MAX_EVENT_BYTES,
    Beat,
    Heartbeat,
    WorkerEvent,
    decode,
)


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
    [b0, b1], events = channel.drain()
    assert events == []
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
    assert [(b.step, b.phase) for b in channel.drain()[0]] == [(0, "train"), (100, "save"), (100, "train")]


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
    assert 0 < len(channel.drain()[0]) <= 5000


def _fill(addr: str) -> socket.socket:
    """Another sender's datagrams fill the agent's queue (the agent not reading) until the next send fails."""
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    beat = Beat(local_rank=9, pid=1, step=0, phase="train", time=0.0).pack()
    while True:
        try:
            filler.sendto(beat, addr)
        except BlockingIOError:
            return filler


def test_a_phase_change_dropped_by_a_full_queue_is_sent_again_by_the_next_beat(channel):
    """A dropped "save" used to count as sent: the throttle then skipped it, so the agent saw the save's silence
    as a hang in phase 'train'."""
    hb = Heartbeat(channel.addr, min_interval_s=60.0)
    hb.beat(4, "train")
    filler = _fill(channel.addr)
    hb.beat(4, "save")  # dropped: EAGAIN
    first = [(b.step, b.phase) for b in channel.drain()[0] if b.local_rank != 9]
    hb.beat(4, "save")  # within the throttle interval, but the agent has not seen this phase yet
    hb.beat(4, "save")  # this one it has: throttled
    second = [(b.step, b.phase) for b in channel.drain()[0] if b.local_rank != 9]
    filler.close()
    assert (first, second) == ([(4, "train")], [(4, "save")])


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


def test_worker_events_reach_the_agent_between_beats_with_rank_kind_and_fields(channel, monkeypatch):
    monkeypatch.setenv(ENV_HEARTBEAT_ADDR, channel.addr)
    monkeypatch.setenv(ENV_AGENT_PID, str(os.getppid()))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "5")
    hb = Heartbeat.from_env()
    hb.event("checkpoint_saved", step=10, url="file:///c/step-00000010", blocking_s=0.012, total_s=1.5, bytes=123)
    hb.beat(10, "train")
    beats, events = channel.drain()
    assert [b.step for b in beats] == [0, 10]
    assert events == [WorkerEvent(local_rank=1, rank=5, pid=os.getpid(), kind="checkpoint_saved",
                                  fields={"step": 10, "url": "file:///c/step-00000010", "blocking_s": 0.012,
                                          "total_s": 1.5, "bytes": 123})]
    hb.close()


def test_an_event_with_a_long_cause_is_cut_to_fit_one_datagram(channel):
    hb = Heartbeat(channel.addr)
    hb.event("checkpoint_failed", step=3, error="x" * (4 * MAX_EVENT_BYTES))
    [ev] = channel.drain()[1]
    assert ev.fields["step"] == 3 and ev.fields["error"].startswith("xxx") and ev.fields["error"].endswith("...")
    assert len(ev.fields["error"]) < MAX_EVENT_BYTES


def test_an_event_too_large_even_when_cut_is_dropped_and_logged_once(channel, caplog):
    hb = Heartbeat(channel.addr)
    many = {f"k{i}": i for i in range(MAX_EVENT_BYTES // 4)}
    with caplog.at_level(logging.WARNING, logger="elastictrain.runtime.heartbeat"):
        hb.event("checkpoint_saved", **many)
        hb.event("checkpoint_saved", **many)
    assert channel.drain()[1] == []
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1


def test_events_without_an_agent_never_raise(tmp_path):
    Heartbeat(None).event("checkpoint_saved", step=1)
    Heartbeat(str(tmp_path / "gone.sock")).event("checkpoint_saved", step=1)


def test_only_worker_event_kinds_are_sent_or_accepted(channel):
    with pytest.raises(ValueError, match="checkpoint_"):
        Heartbeat(channel.addr).event("join", step=1)
    # A datagram claiming an agent kind (it would change the node's state in status) is ignored by the agent.
    forged = WorkerEvent(0, 0, 1, "checkpoint_saved", {}).pack().replace(b'"checkpoint_saved"', b'"succeeded"')
    with pytest.raises(ValueError, match="succeeded"):
        decode(forged)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(forged, channel.addr)
    assert channel.drain() == ([], [])


def test_event_wire_format_roundtrip_and_garbage_rejected():
    ev = WorkerEvent(local_rank=3, rank=None, pid=42, kind="checkpoint_skipped", fields={"url": "u", "reason": "r"})
    assert decode(ev.pack()) == ev
    for bad in (b"E", b"E\x01" + b"\0" * 10 + b"{not json", b"E\x09" + b"\0" * 10 + b"{}"):
        with pytest.raises(ValueError):
            decode(bad)


class _Recorder:
    def __init__(self):
        self.emitted = []

    def _emit(self, kind, **fields):
        self.emitted.append((kind, fields))


def test_agent_emits_worker_events_with_the_reporting_rank_and_keeps_its_own_fields():
    agent = _Recorder()
    ElasticAgent._emit_worker_events(agent, [
        WorkerEvent(0, 2, 99, "checkpoint_loaded", {"step": 10, "saved_world_size": 4, "node": "forged",
                                                     "world_size": 1, "restart_count": 7}),
    ])
    assert agent.emitted == [("checkpoint_loaded", {"step": 10, "saved_world_size": 4, "rank": 2})]


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


def test_a_user_section_phase_crosses_the_wire_and_a_bad_phase_is_refused():
    from elastictrain.runtime.heartbeat import MAX_SECTIONS, Beat, section_phase

    b = Beat(local_rank=1, pid=7, step=3, phase=section_phase(5), time=1.5)
    assert Beat.unpack(b.pack()) == b
    for bad in ("section:x", section_phase(MAX_SECTIONS), "eval"):
        with pytest.raises(ValueError):
            Beat(local_rank=0, pid=1, step=0, phase=bad, time=0.0).pack()
