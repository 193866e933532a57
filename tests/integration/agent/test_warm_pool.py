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

from elastictrain.agent.spares import REFILL_NICE, WarmPool
from elastictrain.runtime.warmstart import (
    _can_leave_idle_policy,
    _can_raise_priority_again,
    assigned_rank,
    idle_spares,
)

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
        assert ran == {"rank": "7", "argv": [str(tmp_path)], "name": "__main__", "prewarmed": True,
                       "nice": os.getpriority(os.PRIO_PROCESS, 0), "policy": os.sched_getscheduler(0)}
        assert (tmp_path / "out.log").read_text() == "worker 7 says hello\n"
        assert idle_spares(os.getpid()) == (0, 0)
        assert pool.served == 1 and pool.serve(0, args, {"RANK": "0"}, None, None) is None  # empty: start cold
    finally:
        pool.close()


@pytest.mark.skipif(not _can_raise_priority_again() or not _can_leave_idle_policy(),
                    reason="needs CAP_SYS_NICE or RLIMIT_NICE (else: normal priority)")
def test_a_refill_imports_at_idle_priority_and_works_at_normal_priority_once_assigned(tmp_path, in_repo):
    """A spare refilled while the job trains imports at nice 19 under SCHED_IDLE (a training worker that wakes on its
    core takes it at once); assigned while still importing, it is back at the agent's priority and policy at once,
    all its threads, and so is the worker it becomes."""
    args = ("-u", "-m", MODULE, str(tmp_path))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    (tmp_path / "hold").touch()  # the spare's imports go on until the file is gone
    pool = WarmPool(sys.executable, args, size=1)
    try:
        assert pool.fill(while_training=True) == 1
        assert _wait(lambda: list(tmp_path.glob("prewarmed-*")))
        (prewarmed,) = tmp_path.glob("prewarmed-*")
        assert json.loads(prewarmed.read_text()) == {"nice": min(19, base + REFILL_NICE), "policy": os.SCHED_IDLE}
        handler = pool.serve(0, args, {"RANK": "0"}, None, None)
        assert handler is not None
        assert _wait(lambda: _thread_sched(handler.proc.pid) == {(base, os.SCHED_OTHER)}, timeout=10), \
            _thread_sched(handler.proc.pid)
        (tmp_path / "hold").unlink()
        assert handler.proc.wait(timeout=60) == 0
        ran = json.loads((tmp_path / f"ran-{handler.proc.pid}.json").read_text())
        assert ran["nice"] == base and ran["policy"] == os.SCHED_OTHER and ran["prewarmed"]
        prewarmed.unlink()
        assert pool.fill() == 1 and _wait(lambda: pool.ready() == 1)  # the first spares: nothing trains yet
        (first,) = tmp_path.glob("prewarmed-*")
        assert json.loads(first.read_text()) == {"nice": base, "policy": os.SCHED_OTHER}
    finally:
        pool.close()


def _thread_sched(pid: int) -> set[tuple[int, int]]:
    """(nice value, scheduling policy) of each of the process's threads (/proc/PID/task/TID/stat fields 19 and 41)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out.add((int(fields[16]), int(fields[38])))
    return out


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


def test_closing_the_pool_kills_spares_still_importing_without_waiting_for_them(tmp_path, in_repo, monkeypatch):
    """An agent's exit waited up to 2 s per refill spare still importing torch (measured: 5.0-5.7 s from the last
    worker's exit to the agent's, 0.5-0.6 s without the wait)."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    pool = WarmPool(sys.executable, ("-m", MODULE, str(tmp_path)), size=2, prewarm=["slow_import"])
    pool.fill()
    procs = [psutil.Process(s.proc.pid) for s in pool._spares]
    assert pool.alive() == 2 and pool.ready() == 0  # importing for the next 600 s
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 2.0, "close waited for the spares' imports"
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
    assert not os.path.exists(pool.dir)


def test_spares_never_outlive_their_agent(tmp_path, in_repo):
    agent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from elastictrain.agent.spares import WarmPool
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


_SURVIVOR = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: time.sleep(float(sys.argv[2])) or sys.exit(0))
time.sleep(float(sys.argv[1]))
sys.exit(int(sys.argv[3]))
"""


def _group(tmp_path, crash_code: int, survivor_exit_s: float) -> dict[int, int]:
    """Local rank 0 exits with `crash_code` after 0.5 s; rank 1 needs `survivor_exit_s` to leave on SIGTERM."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from elastictrain.agent.warm import WarmContext

    pool = WarmPool(sys.executable, ("-c", _SURVIVOR), size=0)
    args = {0: ("-c", _SURVIVOR, "0.5", "0", str(crash_code)), 1: ("-c", _SURVIVOR, "600", str(survivor_exit_s), "0")}
    ctx = WarmContext(pool, name="t", entrypoint=sys.executable, args=args, envs={0: {}, 1: {}},
                      logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    ctx.start()
    try:
        result = ctx.wait(timeout=60)
        assert result is not None, "the group never ended"
        return {lr: f.exitcode for lr, f in result.failures.items()}
    finally:
        ctx.close()
        pool.close()


def test_a_crashed_groups_survivors_are_killed_after_a_short_grace(tmp_path):
    codes = _group(tmp_path, crash_code=1, survivor_exit_s=25)
    assert codes == {0: 1, 1: -signal.SIGKILL}  # torch would have waited 30 s for the SIGTERM handler


def test_workers_leaving_to_re_form_get_the_full_timeout(tmp_path):
    from elastictrain.runtime.exitcodes import EXIT_REFORM

    codes = _group(tmp_path, crash_code=EXIT_REFORM, survivor_exit_s=3)
    assert codes == {0: EXIT_REFORM}  # the survivor finished its work and exited 0 on its own


def test_elastictrain_run_starts_its_spares_from_the_config_before_importing_torch(tmp_path):
    from elastictrain.agent.spares import start_early

    pool = start_early(["--config", str(REPO / "configs" / "tiny-cpu.yaml"), "--nproc-per-node", "3",
                        "--set", "train.steps=5"])
    try:
        assert pool is not None and pool.size == 3 and pool.alive() == 3
        assert pool.args[-4:] == ["--config", str(REPO / "configs" / "tiny-cpu.yaml"), "--set", "train.steps=5"]
    finally:
        if pool is not None:
            pool.close()
    assert start_early(["--config", str(REPO / "configs" / "tiny-cpu.yaml"), "--no-warm-spares"]) is None
    assert start_early(["--config", str(tmp_path / "missing.yaml")]) is None  # the run itself reports it


def test_a_scripts_spares_import_torch_and_the_prewarm_modules_before_they_wait_then_run_the_script(tmp_path):
    from elastictrain.agent.spares import start_early

    script = tmp_path / "train.py"
    script.write_text("import json, os, sys\n"
                      "mods = ('torch', 'torch.distributed', 'elastictrain.runtime.worker', 'csv')\n"
                      "json.dump(sorted(m for m in mods if m in sys.modules),\n"
                      "          open(os.path.join(sys.argv[1], 'preloaded.json'), 'w'))\n")
    pool = start_early(["--nproc-per-node", "2", "--prewarm", "csv", str(script), str(tmp_path)])
    try:
        assert pool is not None and pool.size == 2 and pool.alive() == 2
        assert pool.args == ["-u", str(script), str(tmp_path)]
        assert pool.prewarm == ["torch", "torch.distributed", "elastictrain.runtime.worker", "csv"]
        assert _wait(lambda: pool.ready() == 2, timeout=90), "the spares never finished their imports"
        handler = pool.serve(0, tuple(pool.args), {"RANK": "0"}, None, None)
        assert handler is not None and handler.proc.wait(timeout=60) == 0
        # The script was not run ahead (it found nothing of its own), and found torch and the API already imported.
        assert json.loads((tmp_path / "preloaded.json").read_text()) == [
            "csv", "elastictrain.runtime.worker", "torch", "torch.distributed"]
    finally:
        if pool is not None:
            pool.close()


def test_in_place_the_survivor_stays_up_and_only_the_failed_rank_is_started_again(tmp_path):
    """elastic.in_place: torch's context would stop the survivor on the crash; ours reports the failure, keeps it
    running, and starts the failed local rank alone, with its own environment plus the generation it joins."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from elastictrain.agent.warm import WarmContext

    pool = WarmPool(sys.executable, ("-c", _SURVIVOR), size=0)
    args = {0: ("-c", _SURVIVOR, "0.5", "0", "1"), 1: ("-c", _SURVIVOR, "600", "0", "0")}
    ctx = WarmContext(pool, name="t", entrypoint=sys.executable, args=args, envs={0: {"RANK": "0"}, 1: {"RANK": "1"}},
                      logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    ctx.keep_survivors = True
    ctx.start()
    try:
        survivor = ctx.pids()[1]
        result = ctx.wait(timeout=60)
        assert result is not None and {lr: f.exitcode for lr, f in result.failures.items()} == {0: 1}
        assert psutil.Process(survivor).status() != psutil.STATUS_ZOMBIE, "the survivor was stopped"
        ctx.args[0] = ("-c", _SURVIVOR, "600", "0", "0")  # the replacement runs until it is closed
        pid = ctx.replace(0, {"ELASTICTRAIN_IN_PLACE_GENERATION": "3"})
        assert ctx.pids() == {0: pid, 1: survivor} and pid != result.failures[0].pid
        # (read once the new process has exec'd: a forked child shows an empty environment for a moment)
        assert _wait(lambda: psutil.Process(pid).environ().get("ELASTICTRAIN_IN_PLACE_GENERATION") == "3")
        assert psutil.Process(pid).environ().get("RANK") == "0"
        assert ctx.wait(timeout=1) is None, "the replaced group runs on"
    finally:
        ctx.close()
        pool.close()
