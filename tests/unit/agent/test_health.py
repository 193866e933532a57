"""Hang rule of elastictrain/agent/health.py, driven by a fake clock (plain floats)."""

import pytest

from elastictrain.agent.health import HealthConfig, HealthMonitor
from elastictrain.errors import ConfigError
from elastictrain.runtime.heartbeat import Beat

CFG = HealthConfig(hang_floor_s=2.0, step_time_multiplier=5.0, calibration_min_steps=5, startup_timeout_s=10.0,
                   warmup_timeout_s=20.0, init_timeout_s=30.0, load_timeout_s=40.0, save_timeout_s=50.0,
                   paused_timeout_s=60.0, done_timeout_s=70.0)


def monitor(cfg: HealthConfig = CFG, pids: dict[int, int] | None = None) -> HealthMonitor:
    m = HealthMonitor(cfg)
    m.reset(pids or {0: 100}, now=0.0)
    return m


def beat(m: HealthMonitor, t: float, step: int, phase: str = "train", rank: int = 0, pid: int = 100) -> bool:
    return m.record(Beat(local_rank=rank, pid=pid, step=step, phase=phase, time=t), now=t)


def train(m: HealthMonitor, start: float, steps: range, step_s: float) -> float:
    t = start
    for s in steps:
        beat(m, t, s)
        t += step_s
    return t - step_s


def test_worker_that_never_beats_is_hung_after_startup_allowance():
    m = monitor()
    assert m.check(9.9) == []
    [h] = m.check(10.1)
    assert h.phase is None and h.local_rank == 0 and h.pid == 100
    assert "no heartbeat" in h.describe() and "startup allowance" in h.rule



def test_a_worker_not_expected_to_beat_is_never_hung_for_silence_until_one_has_beaten():
    """A user's script that does not use our worker API never beats: only its exit may fail it."""
    from dataclasses import replace

    m = monitor(replace(CFG, expect_beats=False), pids={0: 100, 1: 101})
    assert m.check(1e6) == []
    beat(m, 5.0, 1, rank=1, pid=101)  # it does beat after all: the startup rule holds for its peers
    assert [h.local_rank for h in m.check(10.1)] == [0]
    m.reset({0: 200}, now=20.0)  # and for the next groups on this node
    [h] = m.check(30.1)
    assert h.phase is None and h.pid == 200

def test_calibrated_timeout_is_multiple_of_p99_step_time_with_floor():
    m = monitor()
    last = train(m, 1.0, range(20), step_s=1.0)
    assert m.step_time() == pytest.approx(1.0)
    assert m.timeout_for("train")[0] == pytest.approx(5.0)
    assert m.check(last + 4.9) == []
    [h] = m.check(last + 5.1)
    assert h.step == 19 and h.phase == "train" and "p99" in h.rule


def test_fast_steps_fall_back_to_the_floor():
    m = monitor()
    last = train(m, 1.0, range(50), step_s=0.01)
    assert m.timeout_for("train")[0] == pytest.approx(2.0)
    assert m.check(last + 1.9) == []
    assert len(m.check(last + 2.1)) == 1


def test_a_rare_slow_step_is_above_p99_but_still_holds_the_timeout_above_it():
    m = monitor()
    t = 0.0
    for s in range(300):
        beat(m, t, s)
        t += 10.0 if s % 250 == 249 else 1.0  # one slow step in 250: above p99
    assert m.step_time() == pytest.approx(1.0)
    assert m.timeout_for("train")[0] == pytest.approx(15.0), "1.5 x the longest step seen"


def test_default_settings_declare_a_stopped_worker_within_5s_and_never_a_job_whose_steps_vary_10x():
    """The defaults (floor 5 s, 5 x p99, 20 steps to calibrate): 0.1 s steps; then 1 s steps with a 10 s one every
    10 steps (an eval, a save's staging)."""
    m = HealthMonitor(HealthConfig())
    m.reset({0: 100}, now=0.0, world_size=2)
    last = train(m, 0.0, range(30), step_s=0.1)
    assert m.check(last + 4.9) == [] and m.check(last + 5.1), "hung within 5 s of the last beat"
    m.reset({0: 101}, now=0.0, world_size=3)  # another world size: no prior calibration
    t = 0.0
    for s in range(200):
        beat(m, t, s, pid=101)
        step = 10.0 if s % 10 == 9 else 1.0
        assert m.check(t + step - 0.01) == [], f"declared hung in step {s + 1} ({step:g}s)"
        t += step


def test_a_hang_in_the_first_20_steps_is_held_to_3x_the_rule_from_5_steps_on_not_the_warmup_allowance():
    m = HealthMonitor(HealthConfig())
    m.reset({0: 100}, now=0.0, world_size=2)
    last = train(m, 0.0, range(8), step_s=2.0)  # 6 step times (the first is left out)
    timeout, rule = m.timeout_for("train")
    assert timeout == pytest.approx(30.0) and "provisional" in rule, rule  # 3 x 5 x 2 s
    assert m.check(last + 29.9) == [] and m.check(last + 30.1)


def test_fast_steps_whose_beats_are_rate_limited_get_the_provisional_rule_from_their_step_count():
    """30 ms steps, a beat every 4th step only (rate-limited) and a save's beat in between: 2 samples after 9 steps,
    yet the group is 9 steps past its first train beat. Seen: such a restarted group, stopped 0.4 s into training,
    was held to the 600 s warm-up allowance and never called hung. Its mean pace sets the provisional rule."""
    m = HealthMonitor(HealthConfig(hang_floor_s=3.0))
    m.reset({0: 100}, now=0.0, world_size=2)
    t = 0.0
    for s in range(8, 18):
        if s == 12:
            beat(m, t, s, phase="save")
        if s % 4 == 0 or s == 8 or s == 17:
            beat(m, t, s)
        t += 0.03
    timeout, rule = m.timeout_for("train")
    assert timeout == pytest.approx(3.0) and "mean step time" in rule, rule
    last = t - 0.03
    assert m.check(last + 2.9) == [] and m.check(last + 3.1), "a stopped worker was not called hung"


def test_calibration_outlives_a_restart_at_the_same_world_size_only():
    """A restarted group is held to twice the previous group's timeout until it calibrates, not to the warm-up
    allowance (20 s here); at another world size the step time changes, so the warm-up allowance applies."""
    m = monitor()
    m.reset({0: 100}, now=0.0, world_size=2)
    last = train(m, 0.0, range(20), step_s=1.0)  # calibrated: 5 s
    m.reset({0: 200}, now=last, world_size=2)
    beat(m, last + 1.0, 20, pid=200)
    assert m.timeout_for("train")[0] == pytest.approx(10.0) and "previous group" in m.timeout_for("train")[1]
    assert m.check(last + 1.0 + 9.9) == [] and m.check(last + 1.0 + 10.1)
    m.reset({0: 300}, now=100.0, world_size=1)
    beat(m, 101.0, 20, pid=300)
    assert m.timeout_for("train")[0] == pytest.approx(20.0), "another world size: the warm-up allowance"


def test_uncalibrated_train_phase_uses_warmup_allowance():
    m = monitor()
    beat(m, 1.0, 0, "init")
    beat(m, 2.0, 1)
    beat(m, 3.0, 2)
    assert m.step_time() is None
    assert m.check(3.0 + 19.9) == []
    assert len(m.check(3.0 + 20.1)) == 1


@pytest.mark.parametrize("phase,allowance", [("init", 30.0), ("load", 40.0), ("save", 50.0), ("paused", 60.0),
                                             ("done", 70.0)])
def test_non_train_phases_have_their_own_allowance(phase, allowance):
    m = monitor()
    train(m, 1.0, range(20), step_s=0.1)  # calibrated: train timeout is the 2 s floor
    beat(m, 10.0, 20, phase)
    assert m.check(10.0 + allowance - 0.1) == []
    [h] = m.check(10.0 + allowance + 0.1)
    assert h.phase == phase and f"{phase} allowance" in h.rule


def test_repeated_beats_of_same_train_step_are_not_progress():
    m = monitor()
    last = train(m, 1.0, range(20), step_s=0.1)
    for k in range(1, 30):
        beat(m, last + 0.1 * k, 19)  # e.g. a background thread beating: no step progress
    assert len(m.check(last + 2.1)) == 1


def test_beats_in_non_train_phases_keep_worker_alive():
    m = monitor()
    train(m, 1.0, range(20), step_s=0.1)
    for k in range(100):
        beat(m, 5.0 + k, 20, "save")  # a long save that keeps reporting
    assert m.check(5.0 + 99 + 49.0) == []


def test_save_phase_does_not_count_as_a_step():
    m = monitor(HealthConfig(hang_floor_s=1.0, calibration_min_steps=1, calibration_window=10))
    beat(m, 0.0, 0)
    beat(m, 1.0, 1)
    beat(m, 1.0, 1, "save")
    beat(m, 100.0, 1, "train")  # 99 s save, then training continues
    beat(m, 101.0, 2)
    assert m.step_time() == pytest.approx(1.0)


def test_step_time_from_throttled_beats_is_per_step():
    m = monitor()
    for k in range(10):
        beat(m, k * 1.0, k * 10)  # beats every 10 steps of 0.1 s
    assert m.step_time() == pytest.approx(0.1)


def test_stale_beats_from_previous_group_or_unknown_rank_are_ignored():
    m = monitor(pids={0: 100, 1: 101})
    assert not beat(m, 1.0, 0, rank=0, pid=99)
    assert not beat(m, 1.0, 0, rank=5, pid=100)
    assert beat(m, 1.0, 0, "init", rank=1, pid=101)
    hung = {h.local_rank for h in m.check(10.5)}
    assert hung == {0}


def test_reset_forgets_workers_and_calibration():
    m = monitor()
    train(m, 1.0, range(20), step_s=1.0)
    m.reset({0: 200}, now=100.0)
    assert m.step_time() is None
    assert m.workers[0].pid == 200 and m.workers[0].last_progress is None
    assert m.check(109.0) == []


def test_only_running_workers_are_judged():
    m = monitor(pids={0: 100, 1: 101})
    assert {h.local_rank for h in m.check(11.0, running={1})} == {1}


def test_disabled_monitor_never_reports():
    m = monitor(HealthConfig(enabled=False))
    assert m.check(1e9) == []


def test_invalid_config_is_rejected_with_a_hint():
    with pytest.raises(ConfigError, match="hang_floor_s"):
        HealthConfig(hang_floor_s=0)
    with pytest.raises(ConfigError, match="quantile"):
        HealthConfig(step_time_quantile=1.5)


def test_lagging_worker_is_reported_first_as_likely_culprit():
    m = monitor(pids={0: 100, 1: 101, 2: 102})
    for s in range(1, 11):
        for r in (0, 1, 2):
            if not (r == 1 and s == 10):  # rank 1 stalls before step 10; its peers wait in step 10's collective
                beat(m, s * 0.1, s, rank=r, pid=100 + r)
    assert [h.local_rank for h in m.check(10.0)] == [1, 0, 2]


def test_a_held_up_watcher_restarts_the_silence_clock_instead_of_blaming_the_worker():
    m = monitor()
    t = train(m, 0.0, range(10), 0.1)  # calibrated: fast steps, the floor rules
    timeout, _ = m.timeout_for("train")
    late = t + timeout + 5  # the agent's own loop stood still this long (beats went unread)
    assert m.check(late), "without a rebase the silence reads as a hang"
    m.rebase(late)
    assert m.check(late) == []
    assert m.check(late + timeout + 0.1), "a worker that stays silent is still caught one timeout later"


def test_a_group_that_sends_no_heartbeats_counts_as_started_after_the_silent_allowance():
    """The agent refills its spares once a group is started; a plain script never reports a step (before: its
    restarts all started cold)."""
    m = monitor(HealthConfig(expect_beats=False))
    assert not m.started_up(5.0, silent_startup_s=10.0)
    assert m.started_up(10.5, silent_startup_s=10.0)


def test_a_group_that_beats_counts_as_started_once_past_its_first_training_step():
    """Refill spares wait for it: the first step after a (re)start is the heaviest, and a spare's imports competed
    with it (150M: 17.6 s instead of 11 s). The first train beat comes after the load, before that step."""
    m = monitor(pids={0: 100, 1: 101})
    assert not m.started_up(100.0, silent_startup_s=10.0), "silence is not start-up for workers that beat"
    for rank in (0, 1):
        beat(m, 1.0, 8, "load", rank=rank, pid=100 + rank)
        beat(m, 2.0, 8, rank=rank, pid=100 + rank)
    assert not m.started_up(2.0, silent_startup_s=10.0), "resumed at step 8, no step made yet"
    beat(m, 9.0, 9, rank=0, pid=100)
    assert not m.started_up(9.0, silent_startup_s=10.0), "rank 1 is still in its first step"
    beat(m, 9.1, 9, "save", rank=1, pid=101)
    assert m.started_up(9.1, silent_startup_s=10.0)


def test_time_left_is_paced_by_the_group_since_its_first_step_and_done_means_finishing():
    m = monitor()
    assert m.seconds_left(100) is None
    beat(m, 1.0, 10)
    assert m.seconds_left(100) is None, "no step made yet"
    beat(m, 3.0, 12)
    assert m.seconds_left(100) == pytest.approx(88.0) and m.seconds_left(5) == 0
    assert not m.finishing()
    beat(m, 3.5, 12, "done")
    assert m.finishing()


def test_a_user_section_is_held_to_its_declared_timeout_else_calibrated_from_its_runs():
    m = monitor()
    train(m, 0.0, range(20), step_s=0.1)  # calibrated: the train timeout is the 2 s floor
    beat(m, 10.0, 20, "section:0")
    assert m.timeout_for("section:0")[0] == pytest.approx(30.0), "before 3 runs: the init allowance"
    assert m.check(10.0 + 29.0) == [], "a 29 s section is not a hang (the step timeout is 2 s)"
    t = 16.0  # that run: 6 s; then two more 6 s runs, a step between
    for _ in range(2):
        beat(m, t, 20, "train")
        beat(m, t + 0.1, 21)
        beat(m, t + 0.2, 21, "section:0")
        t += 6.2
    beat(m, t, 21, "train")
    timeout, rule = m.timeout_for("section:0")
    assert timeout == pytest.approx(30.0, abs=0.6) and "longest of 3 runs" in rule  # 5 x 6 s
    assert m.step_time() == pytest.approx(0.1), "section time is not step time"
    m.declare_section("section:0", "eval", 9.0)
    assert m.timeout_for("section:0") == (9.0, "section 'eval' timeout 9s (declared)")
    assert m.phase_name("section:0") == "section:eval" and m.phase_name("train") == "train"


def test_a_restarted_agent_takes_the_other_nodes_calibration_as_its_prior_for_the_same_world_size():
    """The calibration outlives the agent process: a re-started node's first group is held to 2 x the timeout the
    other nodes' published step time gives, not to the warm-up allowance; its own calibration wins later."""
    from elastictrain.agent.status import NodeStatus, peer_step_times

    nodes = [NodeStatus(node=n, host="h", agent_pid=1, state="running", world_size=w, step_time_s=st)
             for n, w, st in (("a", 4, 1.0), ("b", 4, 1.2), ("c", 2, 2.5), ("me", 4, 9.0), ("d", None, 1.0))]
    priors = peer_step_times(nodes, this_node="me")
    assert priors == {4: 1.2, 2: 2.5}, "the median of the others', per world size; this node's own is stale"
    m = HealthMonitor(CFG)
    m.reset({0: 100}, now=0.0, world_size=4)
    m.adopt_calibration(4, priors[4])
    beat(m, 1.0, 0)
    timeout, rule = m.timeout_for("train")
    assert timeout == pytest.approx(12.0) and "previous group" in rule  # 2 x max(2 s, 5 x 1.2 s)
    m.reset({0: 101}, now=0.0, world_size=2)
    beat(m, 1.0, 0, pid=101)
    assert m.timeout_for("train")[0] == pytest.approx(20.0), "another world size: the warm-up allowance"
