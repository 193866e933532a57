"""`python -m elastictrain.cli.main ARGS` as a process forked from a helper that imported the CLI once.

A fresh `elastictrain` process spends 3-4 s of CPU importing torch before it does anything; a test file that runs
the CLI thirty times spends two minutes on that. The helper is a fresh interpreter that imports the CLI and
nothing else (no threads, no etcd or S3 client); each call forks it, and the child, with the call's own cwd,
environment, stdin and output files, runs the module as `python -m` would. Like a subprocess, a call shares no
state (fsspec caches, logging, argparse) with the test or with other calls, and an operator's view is what it
checks: exit code, stdout, stderr.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

_HELPER = r"""
import json, logging, os, runpy, signal, sys, traceback

import s3fs  # noqa: F401  (botocore and aiohttp: a second or two of every S3 call; no thread starts on import)

from elastictrain.cli.main import build_parser

build_parser()  # the slow part, once: torch and every subcommand's modules
del sys.modules["elastictrain.cli.main"]  # re-run as __main__ below, as `python -m` does (and without its warning)


def child(req):
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, (path, flags) in enumerate([(req["stdin"], os.O_RDONLY), (req["stdout"], os.O_WRONLY),
                                        (req["stderr"], os.O_WRONLY)]):
        os.dup2(os.open(path, flags), fd)
    sys.argv = ["elastictrain", *req["argv"]]
    try:
        runpy.run_module("elastictrain.cli.main", run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:  # what the interpreter makes of sys.exit(code)
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def kill(pid):
    return lambda *_: os.kill(pid, signal.SIGKILL)  # not yet reaped: the pid is still the child's


for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child(req)
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    signal.signal(signal.SIGALRM, kill(pid))
    signal.alarm(req["timeout"])
    _, status = os.waitpid(pid, 0)
    signal.alarm(0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class ForkedCli:
    """One helper process; `run()` is `subprocess.run([python, -m, elastictrain.cli.main, *argv])`, forked."""

    def __init__(self, env: Optional[dict[str, str]] = None) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="forked-cli-"))
        self._proc = subprocess.Popen([sys.executable, "-c", _HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, env=env)
        self._lock = threading.Lock()

    def run(self, argv: list[str], *, cwd: Path, env: dict[str, str], input: str = "",
            timeout: float = 120) -> subprocess.CompletedProcess:
        """Run one command; stdin holds `input` (a file, not a terminal)."""
        paths = {k: self._dir / k for k in ("stdin", "stdout", "stderr")}
        paths["stdin"].write_text(input)
        paths["stdout"].write_text("")
        paths["stderr"].write_text("")
        req = {"argv": argv, "cwd": str(cwd), "env": env, "timeout": max(1, round(timeout)),
               **{k: str(p) for k, p in paths.items()}}
        with self._lock:
            assert self._proc.poll() is None, f"the CLI helper exited with {self._proc.returncode}"
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
            reply = self._proc.stdout.readline()
            assert reply, f"the CLI helper exited with {self._proc.wait()}"
            rc = json.loads(reply)["rc"]
        if rc == -signal.SIGKILL:
            raise subprocess.TimeoutExpired(argv, timeout)
        return subprocess.CompletedProcess(argv, rc, paths["stdout"].read_text(), paths["stderr"].read_text())

    def close(self) -> None:
        """End the helper (it exits when its stdin closes) and remove its files."""
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for p in self._dir.iterdir():
            p.unlink()
        self._dir.rmdir()
