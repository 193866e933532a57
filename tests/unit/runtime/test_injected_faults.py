"""In-worker faults chosen by ELASTICTRAIN_CHAOS: parsing with clear errors, a crash exits, a straggler waits."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from elastictrain.runtime.injected_faults import (
    CHAOS_EXIT_CODE,
    ENV_CHAOS,
    InWorkerFault,
    maybe_inject,
    parse_in_worker_fault,
)


def test_both_forms_parse():
    assert parse_in_worker_fault("crash@step=10,rank=1") == InWorkerFault("crash", 10, 1)
    assert parse_in_worker_fault("slow@ms=50") == InWorkerFault("slow", 0, None, 50)
    assert parse_in_worker_fault("slow@ms=5,step=3,rank=0") == InWorkerFault("slow", 3, 0, 5)
    assert parse_in_worker_fault("slow@ms=5,world=1") == InWorkerFault("slow", 0, None, 5, world=1)


@pytest.mark.parametrize("spec, must_name", [
    ("hang@step=1", "unknown fault 'hang'"),
    ("crash@rank=1", "step=N is required"),
    ("slow@step=4", "ms=N is required"),
    ("crash@ms=5,step=1", "bad field 'ms=5'"),
    ("slow@ms=fast", "bad field 'ms=fast'"),
    ("crash@step=1,world=1", "bad field 'world=1'"),
])
def test_bad_specs_name_the_problem(spec, must_name):
    with pytest.raises(ValueError, match=must_name):
        parse_in_worker_fault(spec)


def test_a_straggler_waits_from_its_step_on_and_only_on_its_rank(monkeypatch):
    monkeypatch.setenv(ENV_CHAOS, "slow@ms=60,step=2,rank=1")
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    maybe_inject(1, 1)  # before its step
    maybe_inject(5, 0)  # another rank
    assert slept == []
    maybe_inject(2, 1)
    maybe_inject(7, 1)
    assert slept == [0.06, 0.06]


def test_a_survivor_slowed_while_alone_steps_at_full_speed_once_the_world_grew(monkeypatch):
    monkeypatch.setenv(ENV_CHAOS, "slow@ms=10,step=2,rank=0,world=2; slow@ms=40,step=2,rank=0,world=1")
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    maybe_inject(1, 0, world_size=2)  # before its step
    maybe_inject(3, 0, world_size=2)  # before the shrink
    maybe_inject(4, 0, world_size=1)  # alone
    maybe_inject(5, 0, world_size=3)  # grown past both
    assert slept == [0.01, 0.04]


def test_a_crash_exits_with_the_chaos_code_at_its_step_only():
    code = ("from elastictrain.runtime.injected_faults import maybe_inject\n"
            "maybe_inject(3, 0); maybe_inject(4, 1); print('alive', flush=True); maybe_inject(4, 0)")
    r = subprocess.run([sys.executable, "-c", code], env={ENV_CHAOS: "crash@step=4,rank=0", "PATH": ""},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == CHAOS_EXIT_CODE and r.stdout == "alive\n", (r.returncode, r.stdout, r.stderr)
    assert "crash at step 4 on rank 0" in r.stderr
