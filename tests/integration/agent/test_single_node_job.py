"""`elastictrain run` with no endpoint (embedded etcd): a SIGKILLed run leaves nothing behind, and neither does a
finished one (no process, and no folder in the temp directory: torch's `torchelastic_*` log folders piled up by the
thousand before)."""

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

from elastictrain.agent.scratch import sweep_orphan_scratch
from tests.integration.recipe_runs import FAST, REPO, worker_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _run_command(tmp_path: Path, steps: int) -> list[str]:
    cmd = [sys.executable, "-m", "elastictrain.cli.main", "run", "--config", str(REPO / "configs/tiny-cpu.yaml")]
    for s in [*FAST, f"train.steps={steps}", f"train.output_dir={tmp_path / 'out'}",
              f"checkpoint.url={tmp_path / 'ck'}"]:
        cmd += ["--set", s]
    return cmd


def _temp_dir(tmp_path: Path) -> Path:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp


def _ours_left(tmp: Path) -> list[str]:
    """What the run left in its temp directory: its scratch folders, embedded etcd's data, torch's log folders."""
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(("elastictrain-", "torchelastic_")))


def test_a_finished_run_leaves_nothing_in_the_temp_directory(tmp_path: Path):
    tmp = _temp_dir(tmp_path)
    run = subprocess.run(_run_command(tmp_path, 6), cwd=REPO, env={**worker_env(), "TMPDIR": str(tmp)},
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert _ours_left(tmp) == [], "a finished run left folders behind"


def test_a_killed_single_node_run_takes_its_etcd_spares_and_workers_with_it(tmp_path: Path):
    tmp = _temp_dir(tmp_path)
    cmd = _run_command(tmp_path, 100000)
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        run = subprocess.Popen(cmd, cwd=REPO, env={**worker_env(), "TMPDIR": str(tmp)}, stdout=log,
                               stderr=subprocess.STDOUT)
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
        # Its folders stay (nobody was left to remove them) until the next agent on the node sweeps them, which the
        # next `elastictrain run` does first: every one of them, the etcd data and torch's error files included.
        assert {"elastictrain-etcd", "elastictrain-logs", "elastictrain-hb"} <= \
            {name.rsplit("-", 2)[0] for name in _ours_left(tmp)}, _ours_left(tmp)
        sweep_orphan_scratch(str(tmp))
        assert _ours_left(tmp) == [], "the sweep left folders of the SIGKILLed run"
    finally:
        if run.poll() is None:
            run.kill()
        for p in descendants:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
