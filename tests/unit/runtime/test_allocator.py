"""The workers' host allocator (runtime/allocator.py, `elastic.worker_malloc`): a worker started by the agent keeps
freed memory for reuse (glibc would give a freed 20 MB block back to the kernel at once, and the next allocation
pays fresh pages again), unless the config says `default` or the environment tunes glibc's malloc itself; and
(`elastic.worker_huge_pages`) its large tensors are backed by huge pages. Real processes: what is observed is the
worker's resident memory after it frees a tensor, and the huge pages the kernel gave it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from elastictrain.runtime.allocator import (
    ENV_TORCH_THP,
    ENV_WORKER_MALLOC,
    MMAP_THRESHOLD,
    TRIM_THRESHOLD,
    user_settings,
    worker_huge_pages_env,
)
from elastictrain.runtime.warmstart import cold_command

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_policy(path: Path = THP_ENABLED) -> Optional[str]:
    """The kernel's transparent huge page policy (`always`, `madvise` or `never`; None where there is none to read).
    torch's advice takes effect under `always` and `madvise`."""
    try:
        text = path.read_text()
    except OSError:
        return None
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None

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


HUGE_SCRIPT = """
import json, sys
import torch

def huge_kb():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))

before = huge_kb()
x = torch.empty(16 << 20)  # 64 MiB: a shard's worth, mapped on its own
x.fill_(1.0)  # first touch
with open(sys.argv[1], "w") as f:
    json.dump({"huge_mb": (huge_kb() - before) / 1024}, f)
"""


def _huge_mb(tmp_path, enabled: bool, **extra: str) -> float:
    """Run HUGE_SCRIPT as a cold worker with the environment the agent gives for `elastic.worker_huge_pages`; how
    much of a 64 MiB tensor the kernel backed with huge pages."""
    script, out = tmp_path / "huge.py", tmp_path / f"huge-{enabled}.json"
    script.write_text(HUGE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != ENV_TORCH_THP}
    env.update(extra)
    env.update(worker_huge_pages_env(enabled, env))
    proc = subprocess.run([sys.executable, *cold_command([str(script), str(out)])], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["huge_mb"]


@pytest.mark.skipif(huge_pages_policy() not in ("always", "madvise"), reason="the kernel gives no huge pages")
def test_a_workers_large_tensors_get_huge_pages_unless_the_config_or_its_environment_says_otherwise(tmp_path):
    assert _huge_mb(tmp_path, True) >= 32  # the first touch faulted 2 MiB at a time (fragmentation may cost some)
    if huge_pages_policy() == "madvise":  # under `always` the kernel backs every large mapping alike
        assert _huge_mb(tmp_path, False) < 8
        assert _huge_mb(tmp_path, True, **{ENV_TORCH_THP: "0"}) < 8  # the user's own switch wins


def test_the_huge_page_switch_and_the_kernels_policy_are_read_as_set(tmp_path):
    assert worker_huge_pages_env(True, {}) == {ENV_TORCH_THP: "1"}
    assert worker_huge_pages_env(True, {ENV_TORCH_THP: "0"}) == {}
    assert worker_huge_pages_env(False, {}) == {}
    policy = tmp_path / "enabled"
    policy.write_text("always [madvise] never\n")
    assert huge_pages_policy(policy) == "madvise"
    policy.write_text("[never]\n")
    assert huge_pages_policy(policy) == "never"
    assert huge_pages_policy(tmp_path / "missing") is None
