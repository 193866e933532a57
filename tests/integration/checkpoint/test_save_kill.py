"""A process killed in each phase of a save leaves nothing that is ever loaded."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from elastictrain.checkpoint.discovery import find_latest_valid, list_checkpoints
from elastictrain.checkpoint.storage import open_storage

from .dist_worker import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PHASES = ["before_data", "after_data", "after_dcp_metadata", "after_manifest", "after_marker"]


def test_kill_in_each_phase_of_a_save_leaves_nothing_that_is_ever_loaded(tmp_path):
    # An async save: the kill hits DCP's background thread, as it would in training.
    def run(phase):
        out = tmp_path / phase
        launch(1, {"scenario": "kill_phase", "url": str(out / "ck"), "phase": phase, "every_steps": 2,
                   "blocking": False}, out / "run", expect_exit={0: 137})
        return out

    with ThreadPoolExecutor(2) as ex:
        outs = dict(zip(PHASES, ex.map(run, PHASES)))
    for phase, out in outs.items():
        st = open_storage(str(out / "ck"))
        latest = find_latest_valid(st, verify=True)
        statuses = {c.step: c.status for c in list_checkpoints(st)}
        if phase == "after_marker":
            assert latest.step == 4, phase  # the marker was written: committed before the kill
        else:
            assert latest.step == 2, phase
            assert statuses.get(4, "absent") in ("torn", "absent"), (phase, statuses)
