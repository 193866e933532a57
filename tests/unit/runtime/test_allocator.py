"""The workers' host allocator (runtime/allocator.py, `elastic.worker_malloc`): a worker started by the agent keeps
freed memory for reuse (glibc would give a freed 20 MB block back to the kernel at once, and the next allocation
pays fresh pages again), unless the config says `default` or the environment tunes glibc's malloc itself. Real
processes: what is observed is the worker's resident memory after it frees a tensor."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from elastictrain.runtime.allocator import ENV_WORKER_MALLOC, MMAP_THRESHOLD, TRIM_THRESHOLD, user_settings
from elastictrain.runtime.warmstart import cold_command

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

SCRIPT = """
import json, os, sys
import torch

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

x = torch.empty(5 << 20)  # 20 MiB: above glibc's first mmap threshold, below the tuned one
x.fill_(1.0)
held = rss()
del x
with open(sys.argv[1], "w") as f:
    json.dump({"given_back_mb": (held - rss()) / 2**20}, f)
"""


def _given_back_mb(tmp_path, mode: str, **extra: str) -> float:
    """Run SCRIPT as the agent starts a worker cold (`warmstart --run-now`) with `elastic.worker_malloc: mode`;
    how much of the freed 20 MiB its resident memory lost."""
    script, out = tmp_path / "alloc.py", tmp_path / f"{mode}.json"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update({ENV_WORKER_MALLOC: mode, **extra})
    proc = subprocess.run([sys.executable, *cold_command([str(script), str(out)])], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["given_back_mb"]


def test_a_worker_keeps_freed_memory_for_reuse_unless_the_config_or_its_environment_says_otherwise(tmp_path):
    assert _given_back_mb(tmp_path, "tuned") < 2  # kept in the process: the next step's allocation reuses it
    assert _given_back_mb(tmp_path, "default") > 18  # glibc as it is: unmapped at once
    # The user's own glibc settings win (here the very ones glibc would use by default).
    assert _given_back_mb(tmp_path, "tuned", MALLOC_MMAP_THRESHOLD_="131072") > 18


def test_tune_malloc_reports_what_it_set_and_leaves_a_users_settings_alone():
    code = ("import json; from elastictrain.runtime.allocator import tune_malloc; "
            "print(json.dumps(tune_malloc()))")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}

    def run(**env: str):
        proc = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                              timeout=60, check=True)
        return json.loads(proc.stdout)

    assert run() == {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
    assert run(**{ENV_WORKER_MALLOC: "default"}) is None
    assert run(GLIBC_TUNABLES="glibc.malloc.trim_threshold=0") is None
    assert user_settings({"MALLOC_TRIM_THRESHOLD_": "0"}) == "MALLOC_TRIM_THRESHOLD_"
    assert user_settings({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}) is None
