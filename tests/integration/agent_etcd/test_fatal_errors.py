"""Errors that restarting cannot fix end a 2-node `elastictrain run` job at once, with their cause everywhere.

Before: each such worker exit (code 2) was charged as a restart, the whole budget was spent on identical failures,
and the job ended as "crash loop ... exited with code 2, no Python traceback", the cause only in a worker log.
"""

from __future__ import annotations

import contextlib
import io
import json
import uuid

import pytest

from elastictrain.cli.main import main
from elastictrain.runtime.exitcodes import EXIT_FATAL
from tests.chaos.cluster import Job
from tests.integration.agent_etcd.job_records import restarts_and_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _status(job: Job) -> dict:
    """`elastictrain status --json` in this process (a fresh one spends seconds importing torch)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["status", "--endpoint", job.endpoint, "--run-id", job.run_id, "--json", "--no-checkpoint"])
    assert rc == 1, out.getvalue() + err.getvalue()  # unhealthy
    return json.loads(out.getvalue())


def assert_ended_at_once(job: Job, cause: str) -> None:
    nodes = job.nodes[-2:]
    codes = job.wait(nodes, timeout=180)
    assert codes == [EXIT_FATAL, EXIT_FATAL], f"both nodes end with EXIT_FATAL\n{job.logs()}"
    for node in nodes:
        assert cause in node.log() and "restarting cannot fix" in node.log(), f"{node.name}\n{job.logs()}"
    used, events = restarts_and_events(job.endpoint, job.run_id)
    assert used == 0, f"no restart may be charged for an error a restart cannot fix\n{job.logs()}"
    joins = [e for e in events if e.kind == "join"]
    assert len(joins) == 2, f"one attempt: each node joined once, got {[(e.node, e.kind) for e in events]}"
    fatal = [e for e in events if e.kind == "fatal"]
    assert fatal and all(cause in e.fields["cause"] for e in fatal), [e.fields for e in fatal]
    status = _status(job)
    assert status["state"] == "failed" and cause in status["fatal"], status
    assert any(cause in p for p in status["problems"]), status["problems"]


def test_checkpoint_of_another_model_shape_ends_the_job_in_one_attempt(tmp_path, etcd):
    ckpt = str(tmp_path / "ckpt")
    # The checkpoint of the narrower model, from a plain 1-rank torchrun run: nothing elastic to test there.
    Job(tmp_path / "first", endpoint="", run_id="narrower", steps=4, ckpt_url=ckpt).run_uninterrupted(1)
    wider = Job(tmp_path / "second", etcd.endpoint, f"shape-b-{uuid.uuid4().hex[:6]}", steps=8, ckpt_url=ckpt,
                extra_overrides=("model.overrides.hidden_size=64", "model.overrides.intermediate_size=128"))
    try:
        wider.start_node("a")
        wider.start_node("b")
        assert_ended_at_once(wider, "does not match")
    finally:
        wider.teardown()


def test_a_config_error_only_the_worker_sees_ends_the_job_in_one_attempt(tmp_path, etcd):
    missing = tmp_path / "no-such-corpus.txt"
    job = Job(tmp_path, etcd.endpoint, f"badpath-{uuid.uuid4().hex[:6]}",
              extra_overrides=("data.source=text", f"data.path={missing}"))
    try:
        job.start_node("a")
        job.start_node("b")
        assert_ended_at_once(job, f"data.path={str(missing)!r} does not exist")
    finally:
        job.teardown()
