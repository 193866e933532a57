"""Checkpoint events reach the job's event log in etcd (worker -> agent -> etcd) and `elastictrain events` shows them.

Two real jobs (`elastictrain run`, one node x 2 workers, etcd) on one checkpoint directory:
1. trains 20 steps, saving at 10 (async) and 20 (final, blocking): one `checkpoint_saved` per save (rank 0's,
   not one per rank), with step, seconds and bytes;
2. after the newest checkpoint (20) was corrupted and a file was put where the save of step 30 must go, resumes:
   `checkpoint_skipped` (20, checksum), `checkpoint_loaded` (10), saved 20, `checkpoint_failed` 30 with its
   cause, saved 40, and retention's `checkpoint_deleted`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from elastictrain.chaos import injectors
from tests.integration.cli.live_job import LiveJob

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _run(endpoint: str, run_id: str, out: Path, steps: int) -> LiveJob:
    # No restart to serve: pre-warmed spares would only add four torch imports of CPU time.
    job = LiveJob(endpoint, run_id, out, steps=steps, extra=["--nnodes=1", "--nproc-per-node=2", "--no-warm-spares"],
                  overrides=[f"checkpoint.url={out.parent / 'ckpt'}", "checkpoint.keep_last=2"])
    job.start_agent()
    try:
        codes = job.wait_exit(timeout=400)
    finally:
        job.stop()
    assert codes == [0], job.logs()
    return job


def _checkpoint_events(job: LiveJob) -> list[dict]:
    r = job.cli("events", "--json")
    assert r.returncode == 0, r.stderr
    return [e for e in map(json.loads, r.stdout.splitlines()) if e["kind"].startswith("checkpoint_")]


def test_checkpoint_saves_failures_and_skipped_checkpoints_are_in_the_etcd_event_log(etcd, run_id, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _run(etcd.endpoint, run_id + "-a", tmp_path / "a", steps=20)
    events = _checkpoint_events(first)
    saved = [e["fields"] for e in events if e["kind"] == "checkpoint_saved"]
    assert [f["step"] for f in saved] == [10, 20], events  # once per save, though both ranks saved
    for f in saved:
        assert f["rank"] == 0 and f["bytes"] > 100_000 and f["url"].endswith(f"step-{f['step']:08d}")
        assert 0 < f["blocking_s"] <= f["total_s"]
    text = first.cli("events", "--kind", "checkpoint_saved").stdout
    assert text.count(" checkpoint_saved ") == 2 and "step=20" in text and "MiB" in text, text

    injectors.corrupt_checkpoint(str(ckpt), rng=random.Random(0))  # flips bytes in step 20's data
    (ckpt / "step-00000030").write_text("not a directory: the save of step 30 fails")
    second = _run(etcd.endpoint, run_id + "-b", tmp_path / "b", steps=40)
    events = _checkpoint_events(second)
    kinds = [(e["kind"], e["fields"].get("step")) for e in events if e["kind"] != "checkpoint_deleted"]
    assert kinds == [("checkpoint_skipped", None), ("checkpoint_loaded", 10), ("checkpoint_saved", 20),
                     ("checkpoint_failed", 30), ("checkpoint_saved", 40)], events
    by_kind = {e["kind"]: e["fields"] for e in events}
    assert by_kind["checkpoint_skipped"]["url"].endswith("step-00000020")
    assert "sha256" in by_kind["checkpoint_skipped"]["reason"] or "checksum" in by_kind["checkpoint_skipped"]["reason"]
    assert by_kind["checkpoint_loaded"]["saved_world_size"] == 2
    assert "step-00000030" in by_kind["checkpoint_failed"]["error"] and by_kind["checkpoint_failed"]["consecutive"] == 1
    assert by_kind["checkpoint_deleted"]["url"].endswith("step-00000010")
    text = second.cli("events").stdout
    assert " checkpoint_failed " in text and " checkpoint_skipped " in text, text
    # Worker events never change a node's state: the job still reads as finished.
    assert second.status()["state"] == "finished"
