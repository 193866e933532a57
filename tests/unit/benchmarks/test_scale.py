"""benchmarks/scale.py: time lost per fault, steps recomputed and the snapshot cost, read from a step timeline."""

from __future__ import annotations

import pytest

from benchmarks.recovery import Completed
from benchmarks.scale import step_time, time_lost, with_rejoin_wait
from benchmarks.scale_results import snapshot_cost, targets


def _group(seq: int, steps: range, t0: float, step_s: float, world: int = 2) -> list[Completed]:
    """A group launched as `seq` completing `steps`, the first at `t0`, then one every `step_s` seconds."""
    return [Completed(t0 + i * step_s, seq, s, world) for i, s in enumerate(steps)]


def test_a_restart_from_the_durable_checkpoint_loses_the_restart_and_the_recomputed_steps():
    # steps 0..12 done (checkpoint at 10), SIGKILL at 13.0; the new group starts at step 10 and its first
    # step completes at 15.0: 2 s of detection, restart and load; then steps 10, 11, 12 again, 13 is one past.
    done = _group(1, range(13), 1.0, 1.0) + _group(2, range(10, 20), 15.0, 1.0)
    lost = time_lost(done, old_seq=1, step_s=1.0, since=13.0)
    assert lost["steps_recomputed"] == 3 and lost["resumed_at_step"] == 10 and lost["reached_step"] == 12
    assert lost["recovery_s"] == pytest.approx(2.0)
    # one step past (13) at 18.0: 5 s after the fault, of which one step would have run anyway
    assert lost["past_s"] == pytest.approx(5.0) and lost["time_lost_s"] == pytest.approx(4.0)


def test_a_restart_from_a_snapshot_of_the_last_step_recomputes_nothing():
    done = _group(1, range(13), 1.0, 1.0) + _group(2, range(13, 20), 14.5, 1.0)
    lost = time_lost(done, old_seq=1, step_s=1.0, since=13.0)
    assert lost["steps_recomputed"] == 0 and lost["time_lost_s"] == pytest.approx(0.5)


def test_no_figure_until_the_new_group_is_past_where_the_job_was():
    done = _group(1, range(13), 1.0, 1.0) + _group(2, range(10, 12), 15.0, 1.0)
    assert time_lost(done, old_seq=1, step_s=1.0, since=13.0) is None
    assert time_lost(_group(1, range(13), 1.0, 1.0), old_seq=1, step_s=1.0, since=13.0) is None


def test_a_rejoin_counts_from_the_last_step_of_the_group_it_interrupts():
    # the survivor (1 rank) trains on while the node starts: its last step 30 completes at 40.0, then the 2-node
    # group resumes at 31 (saved at the stop) and completes it at 43.0; a 2-node step takes 1 s
    survivor = _group(5, range(20, 31), 30.0, 1.0, world=1)
    done = survivor + _group(6, range(31, 35), 43.0, 1.0)
    lost = time_lost(done, old_seq=5, step_s=1.0, world=2)
    assert lost["steps_recomputed"] == 0 and lost["world"] == 2
    assert lost["recovery_s"] == pytest.approx(3.0) and lost["time_lost_s"] == pytest.approx(2.0)
    # a 1-rank group that restarts meanwhile is not the re-join
    assert time_lost(survivor + _group(6, range(31, 33), 43.0, 1.0, world=1), old_seq=5, step_s=1.0, world=2) is None


def test_the_fault_free_step_leaves_out_each_groups_first_steps_and_the_gap_between_groups():
    first = [Completed(0.0, 1, 0, 2), Completed(5.0, 1, 1, 2), Completed(9.0, 1, 2, 2)]  # start-up, first snapshot
    done = first + _group(1, range(3, 8), 10.0, 1.0) + _group(2, range(5, 10), 60.0, 1.0)
    assert step_time(done) == pytest.approx(1.0)
    assert step_time(done[:3]) is None


def test_snapshot_cost_and_targets_pair_configurations_by_trial():
    def run(config, size, trial, step_s, lost, redo):
        fault = {"recovered": True, "time_lost_s": lost, "steps_recomputed": redo}
        return {"config": config, "size": size, "storage": "local", "trial": trial, "step_s": step_s,
                "worker_kill": fault}
    runs = [run("ours-durable", "big", 0, 2.0, 20.0, 3), run("ours-snapshot", "big", 0, 2.1, 2.0, 1),
            run("ours-durable", "big", 1, 4.0, 22.0, 3), run("ours-snapshot", "big", 1, 4.0, 2.4, 1),
            run("stock", "big", 0, 2.0, 30.0, 3), run("ours-snapshot", "tiny", 0, 0.1, 1.0, 0)]
    cost = snapshot_cost(runs)["big"]["local"]
    assert cost["ratios"] == [1.05, 1.0] and cost["ratio_median"] == pytest.approx(1.025)
    summary = {"big": {"local": {"worker_kill": {c: {"time_lost_s_median": v} for c, v in
                                                 (("stock", 30.0), ("ours-snapshot", 2.2))}}},
               "tiny": {"local": {"worker_kill": {"ours-snapshot": {"time_lost_s_median": 1.0}}}}}
    t = targets(summary, runs, {"tiny": {"params": 1}, "big": {"params": 100}})
    assert t["largest_size"] == "big" and t["steps_recomputed_le_1"] is True
    assert t["local:worker_kill"] == {"stock_over_ours_snapshot_at_largest": 13.64, "ge_5x": True,
                                      "ours_snapshot_largest_over_smallest": 2.2, "le_3x": True}
    assert t["local:snapshot_cost_at_largest"] == {"ratio": 1.025, "le_5pct": True}


def test_our_survivor_waits_for_the_restarted_node_whatever_the_launcher_settings():
    tuned = ["run", "--rdzv-conf", "lease_ttl=2,last_call_timeout=1,join_timeout=120", "--heartbeat-timeout", "3"]
    out = with_rejoin_wait(tuned, 60)
    # the wait is at most the last call, and --rdzv-conf keys win over the config's elastic.* values
    assert out == ["run", "--rdzv-conf", "lease_ttl=2,last_call_timeout=60,join_timeout=120,rejoin_wait=60",
                   "--heartbeat-timeout", "3"]
    assert with_rejoin_wait(["run"], 30) == ["run", "--rdzv-conf", "last_call_timeout=30,rejoin_wait=30"]
    assert with_rejoin_wait(tuned, 0) == tuned
