"""benchmarks/recovery.py: faults fire at a fixed offset past the newest committed checkpoint, for every system."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from benchmarks.fault_point import at_offset
from benchmarks.recovery import LedgerWatch, summarize
from elastictrain.checkpoint.manifest import MARKER_NAME, step_dir_name


class _FakeTraining:
    """Two ranks writing the ledger a step every `step_s`; checkpoints every 10 steps, committed `commit_lag` steps
    late."""

    def __init__(self, out: Path, step_s: float = 0.01, commit_lag: int = 2):
        self.out, self.step_s, self.commit_lag = out, step_s, commit_lag
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _FakeTraining:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        (self.out / "samples").mkdir(parents=True, exist_ok=True)
        files = [open(self.out / "samples" / f"rank{r}.jsonl", "a", buffering=1) for r in (0, 1)]
        step = 0
        while not self._stop.is_set():
            for r, f in enumerate(files):
                f.write(json.dumps({"step": step, "rank": r, "world_size": 2, "seq": 0}) + "\n")
            done = step + 1
            if done >= 10 + self.commit_lag and (done - self.commit_lag) % 10 == 0:
                d = self.out / "ckpt" / step_dir_name(done - self.commit_lag)
                d.mkdir(parents=True)
                (d / MARKER_NAME).write_text("{}")
            step += 1
            time.sleep(self.step_s)
        for f in files:
            f.close()


def test_faults_fire_at_the_same_offset_past_the_newest_committed_checkpoint(tmp_path):
    watch = LedgerWatch(tmp_path / "samples")
    try:
        with _FakeTraining(tmp_path):
            for pause in (0.0, 0.033, 0.071):  # the wait starts at different points of the interval
                time.sleep(pause)
                newest, where = at_offset(watch, tmp_path / "ckpt", 5, alive=lambda: True, timeout=30)
                assert where["fault_offset"] == 5
                assert where["ckpt_step"] % 10 == 0 and newest.step + 1 == where["ckpt_step"] + 5
                assert where["fault_step"] == newest.step + 1
    finally:
        watch.close()


def test_an_offset_is_never_taken_from_an_older_checkpoint(tmp_path):
    """A checkpoint committed after the offset was passed must not make the fault fire a whole interval late."""
    watch = LedgerWatch(tmp_path / "samples")
    try:
        with _FakeTraining(tmp_path, commit_lag=3), pytest.raises(AssertionError, match="never saw 2 steps"):
            at_offset(watch, tmp_path / "ckpt", 2, alive=lambda: True, timeout=1.0)
    finally:
        watch.close()


def test_summary_reports_steps_lost_and_offsets_per_system():
    runs = [
        {"system": s, "conf": c, "trial": 0, "fault": "worker_kill", "recovered": True, "recovery_s": 1.0,
         "stall_s": 1.0, "steps_lost": lost, "fault_offset": 5, "ckpt_step": 20}
        for s, c, lost in (("ours", "tuned", 5), ("ours", "defaults", 6), ("stock", "tuned", 5),
                           ("stock", "defaults", 5))
    ] + [{"system": "stock", "conf": "tuned", "trial": 0, "fault": "hang", "recovered": False, "recovery_s": None,
          "steps_lost": None, "fault_offset": 5}]
    plan = [("ours", "tuned"), ("stock", "tuned"), ("ours", "defaults"), ("stock", "defaults")]
    summary, _, lost = summarize(runs, plan)
    assert summary["worker_kill"]["ours:tuned"]["fault_offsets"] == [5]
    assert lost["worker_kill"]["ours"] == {"steps_lost_median": 5.5, "steps_lost": [5, 6], "fault_offsets": [5, 5]}
    assert lost["worker_kill"]["stock"] == {"steps_lost_median": 5, "steps_lost": [5, 5], "fault_offsets": [5, 5]}
    assert lost["hang"]["stock"] == {"steps_lost_median": None, "steps_lost": [], "fault_offsets": []}
