"""The spare worker's command parsing and rank lookup (runtime/warmstart.py)."""

from __future__ import annotations

import pytest

from elastictrain.runtime.warmstart import ENV_WARM_DIR, Target, assigned_rank, parse_command, rank_file


@pytest.mark.parametrize("argv, expected", [
    (["-u", "-m", "elastictrain.recipes.lm", "--config", "c.yaml"],
     Target("elastictrain.recipes.lm", None, ["--config", "c.yaml"], True)),
    (["-m", "pkg.mod"], Target("pkg.mod", None, [], False)),
    (["-u", "train.py", "-m", "x"], Target(None, "train.py", ["-m", "x"], True)),
])
def test_worker_commands_split_like_the_interpreter_does(argv, expected):
    assert parse_command(argv) == expected


def test_a_command_without_module_or_script_is_refused():
    with pytest.raises(ValueError, match="no module or script"):
        parse_command(["-u"])


def test_rank_comes_from_the_environment_then_the_assignment_file(tmp_path):
    assert assigned_rank(42, {"RANK": "3"}) == 3
    env = {ENV_WARM_DIR: str(tmp_path)}
    assert assigned_rank(42, env) is None  # an idle spare is nobody's worker
    with open(rank_file(str(tmp_path), 42), "w") as f:
        f.write("5")
    assert assigned_rank(42, env) == 5
    assert assigned_rank(42, {}) is None
