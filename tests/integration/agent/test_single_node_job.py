"""`elastictrain run` with no endpoint (embedded etcd): a SIGKILLed run leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.recipe_runs import FAST, REPO, worker_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_killed_single_node_run_takes_its_etcd_spares_and_workers_with_it(tmp_path: Path):
    cmd = [sys.executable, "-m", "elastictrain.cli.main", "run", "--config", str(REPO / "configs/tiny-cpu.yaml")]
    for s in [*FAST, "train.steps=100000", f"train.output_dir={tmp_path / 'out'}", f"checkpoint.url={tmp_path / 'ck'}"]:
        cmd += ["--set", s]
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        run = subprocess.Popen(cmd, cwd=REPO, env=worker_env(), stdout=log, stderr=subprocess.STDOUT)
    descendants: list[int] = []
    try:
        deadline = time.monotonic() + 240
        refilled = re.compile(r"spare worker\(s\) ready$", re.MULTILINE)  # the refill after the group trains
        while time.monotonic() < deadline and not refilled.search(log_path.read_text(errors="replace")):
            assert run.poll() is None, log_path.read_text(errors="replace")
            time.sleep(0.2)
        text = log_path.read_text(errors="replace")
        etcd_pid = int(re.search(r"started etcd pid=(\d+)", text).group(1))
        descendants = [p.pid for p in psutil.Process(run.pid).children(recursive=True)]
        assert etcd_pid in descendants and len(descendants) >= 5  # etcd, 2 workers, 2 idle spares
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in descendants):
            time.sleep(0.2)
        left = [(p, psutil.Process(p).cmdline()[:3]) for p in descendants if _alive(p)]
        assert not left, f"outlived a SIGKILLed `elastictrain run`: {left}"
    finally:
        if run.poll() is None:
            run.kill()
        for p in descendants:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
