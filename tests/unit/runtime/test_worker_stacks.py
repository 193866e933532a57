"""A worker our agent started writes every thread's Python stack on SIGUSR2 (where a stuck worker waits), and leaves
a script's own SIGUSR2 handler alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from elastictrain.runtime.heartbeat import ENV_AGENT_PID

_SCRIPT = """
import signal, sys, time
if sys.argv[1] == "own":
    signal.signal(signal.SIGUSR2, lambda *a: print("own handler", flush=True))
from elastictrain.runtime.worker import _stacks_on_sigusr2
_stacks_on_sigusr2()
print("ready", flush=True)
def waiting_here():
    time.sleep(30)
waiting_here()
"""


def _signalled(mode: str) -> tuple[str, str]:
    env = {**os.environ, ENV_AGENT_PID: str(os.getpid())}
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, mode], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR2)
        time.sleep(1.0)
    finally:
        proc.kill()
        out, err = proc.communicate(timeout=30)
    return out, err


def test_sigusr2_writes_the_stacks_of_a_worker_started_by_our_agent() -> None:
    _, err = _signalled("default")
    assert "waiting_here" in err and "Current thread" in err, err[-2000:]


def test_a_scripts_own_sigusr2_handler_is_kept() -> None:
    out, err = _signalled("own")
    assert "own handler" in out and "waiting_here" not in err, (out, err[-2000:])
