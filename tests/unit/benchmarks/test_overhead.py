"""benchmarks/overhead.py: the public API's step loop against the same loop by hand, on the API as it is today."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.overhead import SIZES, summarize

ROOT = Path(__file__).resolve().parents[3]


def test_figure_is_the_ratio_of_the_medians_over_rounds_with_the_per_round_spread():
    rounds = [{"hand_s": h, "api_s": a, "ratio": a / h} for h, a in [(1.0, 1.02), (2.0, 2.0), (1.5, 1.8)]]
    out = summarize(rounds)
    assert out["median_step_s"] == {"hand": 1.5, "api": 1.8}
    assert out["ratio_api_over_hand"] == pytest.approx(1.2)
    assert out["per_round_ratio"] == {"median": pytest.approx(1.02), "min": 1.0, "max": pytest.approx(1.2)}
    assert not out["meets_target"]


@pytest.mark.parametrize("name", sorted(SIZES))
def test_every_size_gives_each_of_two_ranks_the_same_whole_micro_batches(name):
    size = SIZES[name]
    assert size.global_batch % (size.micro_batch * 2) == 0


@pytest.mark.slow
def test_runs_both_loops_on_two_ranks_and_the_heartbeats_arrive(tmp_path):
    out = tmp_path / "overhead.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/overhead.py"), "--sizes", "mlp", "--rounds", "2",
                           "--steps-per-round", "2", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    mlp = res["sizes"]["mlp"]
    assert [r["first"] for r in mlp["rounds"]] == ["hand", "api"]
    assert mlp["median_step_s"]["hand"] > 0 and mlp["median_step_s"]["api"] > 0
    assert mlp["micro_batches_per_rank"] == 2
    # Phase changes are always sent (init, load, train, done on each rank): the workers really reached the socket.
    assert res["heartbeats_received"] >= 8
    assert res["command"].startswith("python benchmarks/overhead.py")
