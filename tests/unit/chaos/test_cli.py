"""`elastictrain chaos` argument handling: schedules from text, files and seeds; errors that name the fix."""

from __future__ import annotations

import pytest

from elastictrain.cli.main import main


def test_dry_run_prints_the_plan_without_a_job(capsys):
    assert main(["chaos", "--schedule", "kill-worker@step=4, kill-node:node1@t=30s/3s", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "kill-worker@step=4" in out and "on a seeded choice of live node, nothing to heal" in out
    assert "at t=30s on node1, healed after 3s" in out


def test_schedule_from_a_file(tmp_path, capsys):
    f = tmp_path / "faults.txt"
    f.write_text("stop-worker#1@step=10\ncorrupt-checkpoint@step=20\n")
    assert main(["chaos", "--schedule", f"@{f}", "--dry-run"]) == 0
    assert "healed after 10s (default)" in capsys.readouterr().out


def test_random_schedule_is_seeded(capsys):
    args = ["chaos", "--random", "5", "--every", "20", "--seed", "4", "--kinds", "kill-worker,stop-worker",
            "--dry-run"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first and "seed 4, 5 fault(s)" in first


@pytest.mark.parametrize("argv,fix", [
    (["--schedule", "kill-wrker@step=3"], "use one of kill-worker"),
    (["--random", "2", "--schedule", "kill-worker"], "exactly one of --schedule"),
    ([], "exactly one of --schedule"),
    (["--schedule", "@/nonexistent/faults.txt"], "cannot read the file"),
    (["--schedule", "kill-worker", "--rdzv-id", "x"], "--endpoint"),
])
def test_errors_exit_2_and_name_the_fix(capsys, monkeypatch, argv, fix):
    monkeypatch.delenv("ELASTICTRAIN_ENDPOINT", raising=False)
    assert main(["chaos", *argv, *([] if "--rdzv-id" in argv else ["--dry-run"])]) == 2
    assert fix in capsys.readouterr().err
