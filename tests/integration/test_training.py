"""2-process FSDP2 training on CPU under torchrun: determinism and exact sample accounting."""

import math
from pathlib import Path

import pytest

from elastictrain.runtime.audit import committed_timeline
from tests.integration.recipe_runs import assert_same_train_state, run_recipe

pytestmark = pytest.mark.slow

RUN = ["train.steps=12", "train.audit_samples=true"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, dict]:
    """A 2-rank run (output dir, summary): the first of the two identical runs, and the one the 1-process run is
    compared with (one run fewer than a baseline of its own)."""
    out = tmp_path_factory.mktemp("two")
    return out, run_recipe(out, 2, RUN)


def test_two_runs_with_the_same_seed_are_bitwise_identical(two_ranks, tmp_path):
    _, a = two_ranks
    b = run_recipe(tmp_path / "b", 2, RUN)
    assert a["final_step"] == 12 and a["world_size"] == 2
    assert_same_train_state(a, b)
    assert a["losses"] == b["losses"]  # exact float equality, every step
    assert a["losses"]["12"] < a["losses"]["1"]  # and it learns


def test_one_process_with_accumulation_consumes_the_same_samples_as_two(two_ranks, tmp_path):
    two_out, two = two_ranks
    one = run_recipe(tmp_path / "one", 1, RUN)
    t1, t2 = committed_timeline(tmp_path / "one/samples"), committed_timeline(two_out / "samples")
    assert sorted(t1) == list(range(12))
    assert t1 == t2  # the same samples at every step
    for step in t1:
        assert len(t1[step]) == 8 and len(set(t1[step])) == 8  # the global batch, no duplicates
    # same data, same global batch: only the reduction order differs
    for k, v in one["losses"].items():
        assert math.isclose(v, two["losses"][k], rel_tol=1e-4), (k, v, two["losses"][k])
