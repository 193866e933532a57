"""Fault injectors on real processes, real mounts and real DCP checkpoints (no training job, no services)."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from elastictrain.chaos import injectors
from elastictrain.chaos.runner import UnsupportedFault
from elastictrain.checkpoint.discovery import find_latest_valid, list_checkpoints, verify_files
from elastictrain.checkpoint.storage import open_storage
from tests.unit.checkpoint.conftest import write_checkpoint

# A fake launcher: starts `nworkers` children that look like training workers (module name in the command line,
# RANK in the environment), writes "ready" to stdout, and on SIGTERM writes "drained" and exits 0.
LAUNCHER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "elastictrain.recipes.lm"],
                             env={**os.environ, "RANK": str(int(sys.argv[1]) + r)}, start_new_session=True)
            for r in range(2)]
    def drain(*_):
        for k in kids:
            k.kill()
        print("drained", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, drain)
    print("ready", os.environ.get("CHAOS_TEST_MARK"), flush=True)
    time.sleep(120)
""")


class Launchers:
    """Fake launchers started by a test, all killed at teardown (re-launched copies included)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.pids: list[int] = []

    def start(self, first_rank: int = 0) -> tuple[int, Path]:
        log = self.tmp / f"launcher-{len(self.pids)}.log"
        with open(log, "ab") as out:
            p = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(first_rank)], stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "CHAOS_TEST_MARK": "m42"}, cwd=self.tmp)
        self.pids.append(p.pid)
        deadline = time.monotonic() + 30
        while "ready" not in log.read_text() or len(injectors.process_signals.worker_pids(p.pid)) < 2:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        return p.pid, log

    def cleanup(self) -> None:
        for pid in self.pids:
            if not injectors.is_gone(pid):
                injectors.process_signals.kill_node(pid)
        for pid in self.pids:
            injectors.wait_gone(pid, 10)


def _until(pred, timeout: float = 10.0) -> bool:
    """Signals are delivered asynchronously: poll for their effect."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _stopped(pid: int) -> bool:
    return psutil.Process(pid).status() == psutil.STATUS_STOPPED


@pytest.fixture
def launchers(tmp_path):
    ls = Launchers(tmp_path)
    yield ls
    ls.cleanup()


def test_kill_worker_kills_the_named_rank_only(launchers):
    pid, _ = launchers.start(first_rank=4)
    workers = injectors.process_signals.worker_pids(pid)
    detail, heal = injectors.kill_worker(pid, rank=5)
    assert heal is None and f"pid {workers[5]}" in detail and "rank 5" in detail
    assert injectors.wait_gone(workers[5], 10)
    assert not injectors.is_gone(workers[4])


def test_seeded_worker_choice_is_reproducible(launchers):
    pid, _ = launchers.start()
    picks = {injectors.choose_worker(pid, None, random.Random(9))[0] for _ in range(5)}
    assert len(picks) == 1


def test_unknown_rank_is_unsupported_and_names_the_ranks(launchers):
    pid, _ = launchers.start()
    with pytest.raises(UnsupportedFault, match=r"\[0, 1\]"):
        injectors.kill_worker(pid, rank=7)


def test_stop_worker_stops_until_healed(launchers):
    pid, _ = launchers.start()
    worker = injectors.process_signals.worker_pids(pid)[1]
    _, heal = injectors.stop_worker(pid, rank=1)
    assert _until(lambda: _stopped(worker))
    assert "SIGCONT" in heal()
    assert _until(lambda: not _stopped(worker))


def test_kill_node_kills_everything_and_the_heal_relaunches_the_same_command(launchers):
    pid, log = launchers.start()
    workers = list(injectors.process_signals.worker_pids(pid).values())
    detail, heal = injectors.kill_node(pid)
    assert "SIGKILL agent" in detail
    assert all(injectors.wait_gone(p, 10) for p in [pid, *workers])
    said = heal()
    new = int(said.split("pid ")[1].split()[0])
    launchers.pids.append(new)
    deadline = time.monotonic() + 30
    while log.read_text().count("ready m42") < 2:  # same environment, output appended to the same log
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    assert psutil.Process(new).cmdline()[-1] == "0" and psutil.Process(new).cwd() == str(launchers.tmp)
    assert os.getpgid(new) == new, "re-launched in a session of its own"


def test_kill_node_heal_skips_the_relaunch_when_the_job_finished(launchers):
    pid, _ = launchers.start()
    _, heal = injectors.kill_node(pid, should_relaunch=lambda: False)
    assert "not re-launched" in heal()


def test_drain_node_terms_the_agent_and_relaunches_it_after_it_exited(launchers):
    pid, log = launchers.start()
    detail, heal = injectors.drain_node(pid, exit_timeout=20)
    assert "SIGTERM" in detail
    said = heal()
    launchers.pids.append(int(said.split("pid ")[1].split()[0]))
    assert "drained" in log.read_text() and injectors.is_gone(pid)


def test_restart_server_kills_then_runs_the_restart(launchers):
    pid, _ = launchers.start()
    calls = []
    detail, heal = injectors.restart_server(pid, lambda: calls.append(injectors.is_gone(pid)) or "restarted",
                                            sig=signal.SIGTERM, what="etcd")
    assert detail == f"SIGTERM etcd pid {pid}"
    assert heal() == "restarted" and calls == [True], "restart only once the old server is gone"


def test_stall_process_stops_and_continues(launchers):
    pid, _ = launchers.start()
    _, heal = injectors.stall_process(pid)
    assert _until(lambda: _stopped(pid))
    heal()
    assert _until(lambda: not _stopped(pid))


def _mounting(fn, path):
    try:
        return fn(str(path))
    except UnsupportedFault as e:
        pytest.skip(f"mounting not permitted here: {e}")


def test_storage_readonly_makes_writes_fail_with_erofs_until_healed(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "old").write_text("kept")
    detail, heal = _mounting(injectors.storage_readonly, d)
    try:
        assert "read-only" in detail
        with pytest.raises(OSError) as e:
            (d / "new").write_text("x")
        assert e.value.errno == errno.EROFS
        assert (d / "old").read_text() == "kept"
    finally:
        heal()
    (d / "new").write_text("x")
    assert (d / "new").read_text() == "x"


def test_storage_full_makes_writes_fail_with_enospc_and_leaves_no_trace(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "old").write_text("kept")
    detail, heal = _mounting(injectors.storage_full, d)
    try:
        assert "full" in detail
        assert (d / "old").read_text() == "kept", "existing checkpoints stay readable"
        with pytest.raises(OSError) as e:
            with open(d / "new", "wb") as f:
                f.write(b"\0" * (1 << 20))
        assert e.value.errno == errno.ENOSPC
    finally:
        heal()
    assert sorted(p.name for p in d.iterdir()) == ["old"]
    (d / "new").write_bytes(b"\0" * (1 << 20))


def test_directory_faults_refuse_a_url_that_is_no_directory():
    with pytest.raises(UnsupportedFault):
        injectors.storage_readonly("s3://bucket/prefix")


def test_corrupt_checkpoint_flips_the_newest_so_loading_falls_back(tmp_path):
    storage = open_storage(str(tmp_path / "ckpts"))
    write_checkpoint(storage, 4)
    write_checkpoint(storage, 8)
    detail, heal = injectors.corrupt_checkpoint(storage.url, rng=random.Random(0))
    assert heal is None and "step-00000008" in detail and "(step 8)" in detail
    newest = next(c for c in list_checkpoints(storage) if c.step == 8)
    assert newest.valid, "sizes are unchanged: only the checksums can tell"
    assert any("sha256 mismatch" in p for p in verify_files(storage, newest))
    assert find_latest_valid(storage, verify=True).step == 4


def test_corrupt_checkpoint_without_a_checkpoint_is_unsupported(tmp_path):
    with pytest.raises(UnsupportedFault, match="no committed checkpoint"):
        injectors.corrupt_checkpoint(str(tmp_path / "empty"))
