"""The spare worker (runtime/warmstart.py): its command parsing, rank lookup, and how it leaves after a script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elastictrain.runtime.warmstart import (
    ENV_WARM_DIR,
    Target,
    _can_raise_priority_again,
    assigned_rank,
    parse_command,
    rank_file,
)


@pytest.mark.parametrize("argv, expected", [
    (["-u", "-m", "elastictrain.recipes.lm", "--config", "c.yaml"],
     Target("elastictrain.recipes.lm", None, ["--config", "c.yaml"], True)),
    (["-m", "pkg.mod"], Target("pkg.mod", None, [], False)),
    (["-u", "train.py", "-m", "x"], Target(None, "train.py", ["-m", "x"], True)),
])
def test_worker_commands_split_like_the_interpreter_does(argv, expected):
    assert parse_command(argv) == expected


def test_a_command_without_module_or_script_is_refused():
    with pytest.raises(ValueError, match="no module or script"):
        parse_command(["-u"])


def test_rank_comes_from_the_environment_then_the_assignment_file(tmp_path):
    assert assigned_rank(42, {"RANK": "3"}) == 3
    env = {ENV_WARM_DIR: str(tmp_path)}
    assert assigned_rank(42, env) is None  # an idle spare is nobody's worker
    with open(rank_file(str(tmp_path), 42), "w") as f:
        f.write("5")
    assert assigned_rank(42, env) == 5
    assert assigned_rank(42, {}) is None


SCRIPT = """
import atexit, concurrent.futures, json, os, sys, threading
import torch.distributed as dist

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
out = sys.argv[1]
left_open = open(out + ".log", "w")  # never closed: the interpreter's teardown would flush it
left_open.write("written, never closed")


def late():  # a non-daemon thread the interpreter waits for at exit
    import time
    time.sleep(0.3)
    with open(out + ".thread", "w") as f:
        f.write("done")


threading.Thread(target=late).start()
concurrent.futures.ThreadPoolExecutor(1).submit(lambda: None)  # never shut down: its idle worker must not hold the exit

@atexit.register
def report():  # as under `python script.py`, the group is still there for the script's own exit handlers
    alive = dist.is_initialized()
    if alive:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({{"group_alive_at_exit": alive}}, f)

how = sys.argv[2]
if how == "exit2":
    sys.exit(2)
if how == "message":
    sys.exit("bad input")
if how == "raise":
    raise RuntimeError("boom")
"""


def _script(tmp_path):
    """The script above, on a free loopback port, and the file its atexit handler writes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(port=port))
    return script, tmp_path / "report.json"


@pytest.mark.parametrize("how, code, stderr", [
    ("exit2", 2, ""), ("message", 1, "bad input"), ("raise", 1, "RuntimeError: boom"), ("finish", 0, ""),
])  # fmt: skip
def test_a_spare_running_a_script_exits_with_its_code_its_atexit_run_and_its_groups_destroyed(
        tmp_path, how, code, stderr):
    """A plain torch script seldom destroys its process group; left to the interpreter's teardown, torch 2.13's gloo
    group now and then aborts the process (SIGABRT instead of the script's code: a `sys.exit(2)` that was to end the
    job became a restart). The spare waits for the script's threads, runs its atexit handlers with its group still
    there (one that destroys the group itself raises nothing), destroys what is left and exits with the code
    `python script.py` would give."""
    import subprocess
    import sys

    script, report = _script(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "elastictrain.runtime.warmstart", str(script)], text=True,
                          input=json.dumps({"env": dict(os.environ, ELASTICTRAIN_PREWARM="torch"),
                                            "args": [str(script), str(report), how]}) + "\n",
                          capture_output=True, timeout=120)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert stderr in proc.stderr and "terminate called" not in proc.stderr and "atexit" not in proc.stderr
    assert json.loads(report.read_text()) == {"group_alive_at_exit": True}
    assert (tmp_path / "report.json.log").read_text() == "written, never closed"
    assert (tmp_path / "report.json.thread").read_text() == "done"


def test_a_worker_started_cold_runs_through_the_spares_module_and_leaves_as_a_spare_does(tmp_path):
    """With no spare left, a worker starts cold as `python [flags] -m warmstart --run-now <its command>`: the same
    exit handling (its groups destroyed, its code kept), without waiting for an assignment."""
    import subprocess
    import sys

    from elastictrain.runtime.warmstart import cold_command

    assert cold_command(["-u", "train.py", "--x", "1"]) == ["-u", "-m", "elastictrain.runtime.warmstart",
                                                            "--run-now", "-u", "train.py", "--x", "1"]
    assert cold_command(["-m", "pkg.mod"]) == ["-m", "elastictrain.runtime.warmstart", "--run-now", "-m", "pkg.mod"]
    for as_is in (["-c", "print(1)"], ["-W", "ignore", "train.py"], ["-u"]):
        assert cold_command(as_is) == as_is  # options whose arguments this module's parsing does not know
    script, report = _script(tmp_path)
    proc = subprocess.run([sys.executable, *cold_command([str(script), str(report), "exit2"])], text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert json.loads(report.read_text()) == {"group_alive_at_exit": True}


def test_groups_a_script_left_are_aborted_after_a_failure_and_destroyed_before_the_exit(tmp_path):
    """What `_leave` does with the groups the script did not destroy: after a failure they are aborted at once (a
    collective still pending returns; the group stays for the script's atexit handlers to destroy), and at the end
    destroyed (torch's teardown then has none to abort on)."""
    import subprocess
    import sys

    code = """
import socket, sys
import torch.distributed as dist
from elastictrain.runtime.warmstart import abort_process_groups, destroy_process_groups
destroy_process_groups()  # nothing to do: no group yet
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
abort_process_groups()
print("aborted, initialized:", dist.is_initialized())
destroy_process_groups()
print("initialized after:", dist.is_initialized())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["aborted, initialized: True", "initialized after: False"], proc.stdout


def test_a_spare_that_could_not_raise_its_priority_again_imports_at_normal_priority(monkeypatch):
    """Unprivileged (no CAP_SYS_NICE, RLIMIT_NICE 0): lowering it would leave the worker slow for good."""
    from elastictrain.runtime import warmstart

    monkeypatch.setattr(warmstart, "_can_raise_priority_again", lambda: False)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    restore = warmstart.import_nicely("19")
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
    restore()
    warmstart.import_nicely("")  # not a refill: nothing asked
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


@pytest.mark.skipif(not _can_raise_priority_again(), reason="needs CAP_SYS_NICE or RLIMIT_NICE (else: normal priority)")
def test_a_spare_that_could_not_leave_the_idle_policy_again_imports_at_nice_19_only() -> None:
    """Where SCHED_IDLE could not be undone (not Linux, or the kernel refuses), a refill keeps its normal policy and
    is niced only; assigned, its priority is back."""
    code = ("import os, sys\n"
            "from elastictrain.runtime import warmstart as w\n"
            "w._can_leave_idle_policy = lambda: False\n"
            "base = os.getpriority(os.PRIO_PROCESS, 0)\n"
            "restore = w.import_nicely('19')\n"
            "print(os.getpriority(os.PRIO_PROCESS, 0) - base, os.sched_getscheduler(0), flush=True)\n"
            "restore()\n"
            "print(os.getpriority(os.PRIO_PROCESS, 0) - base, os.sched_getscheduler(0), flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    importing = proc.stdout.readline().split()  # stdin stays open until then: no assignment yet
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert int(importing[1]) == os.SCHED_OTHER and int(importing[0]) > 0, importing
    assert rest.split() == ["0", str(os.SCHED_OTHER)], rest
