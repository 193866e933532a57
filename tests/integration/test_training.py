"""2-process FSDP2 training on CPU under torchrun: determinism and exact sample accounting."""

import math

import pytest

from elastictrain.runtime.audit import committed_timeline
from tests.integration.recipe_runs import assert_same_train_state, run_recipe

pytestmark = pytest.mark.slow


def test_two_runs_with_the_same_seed_are_bitwise_identical(tmp_path):
    a = run_recipe(tmp_path / "a", 2, ["train.steps=12"])
    b = run_recipe(tmp_path / "b", 2, ["train.steps=12"])
    assert a["final_step"] == 12 and a["world_size"] == 2
    assert_same_train_state(a, b)
    assert a["losses"] == b["losses"]  # exact float equality, every step
    assert a["losses"]["12"] < a["losses"]["1"]  # and it learns


def test_one_process_with_accumulation_consumes_the_same_samples_as_two(tmp_path):
    one = run_recipe(tmp_path / "one", 1, ["train.steps=6", "train.audit_samples=true"])
    two = run_recipe(tmp_path / "two", 2, ["train.steps=6", "train.audit_samples=true"])
    t1, t2 = committed_timeline(tmp_path / "one/samples"), committed_timeline(tmp_path / "two/samples")
    assert sorted(t1) == list(range(6))
    assert t1 == t2  # the same samples at every step
    for step in t1:
        assert len(t1[step]) == 8 and len(set(t1[step])) == 8  # the global batch, no duplicates
    # same data, same global batch: only the reduction order differs
    for k, v in one["losses"].items():
        assert math.isclose(v, two["losses"][k], rel_tol=1e-4), (k, v, two["losses"][k])
