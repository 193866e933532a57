"""Rendering of `elastictrain status` / `events` from hand-made records, and --since parsing."""

import json

import pytest

from elastictrain.agent.jobstate import CheckpointView, Rendezvous, derive
from elastictrain.cli.events import parse_since
from elastictrain.cli.status import format_event, render, table
from elastictrain.errors import ConfigError
from tests.unit.agent.test_jobstate import NOW, node


def _view():
    v = derive("demo", [node("a", step=120), node("b", "recovering", since=NOW - 4, step=118)], NOW)
    v.rendezvous = Rendezvous(round=3, complete=True, closed=False, participants=2, waiting=0)
    v.checkpoint = CheckpointView(step=110, age_s=42.0, url="s3://bucket/run/step-00000110")
    v.checkpoint_url, v.checkpoint_checked = "s3://bucket/run", True
    v.events = [{"time": NOW - 4, "node": "b", "kind": "failure",
                 "fields": {"cause": "rank 1: Signal 9 (SIGKILL)", "pids": {"0": 5}, "time": 1}}]
    return v


def test_table_shows_state_round_budget_checkpoint_members_and_events():
    text = render(_view())
    lines = text.splitlines()
    assert lines[0].startswith("run demo: RECOVERING (healthy) since ")
    assert "rendezvous: round 3, complete, 2 participant(s), 0 waiting" in text
    assert "restarts:   0 of 3 used" in text
    assert "checkpoint: step 110, 42s ago, s3://bucket/run/step-00000110" in text
    header = next(line for line in lines if line.startswith("NODE"))
    assert header.split() == ["NODE", "HOST", "RANK", "STATE", "WORKERS", "HEARTBEAT", "STEP", "STEP", "TIME",
                              "UPDATED"]
    row_b = next(line for line in lines if line.startswith("b "))
    assert row_b.split()[:5] == ["b", "host-b", "0", "recovering", "1"]
    assert "failure  cause=rank 1: Signal 9 (SIGKILL)" in text and "pids" not in text


def test_unhealthy_view_lists_its_problems_and_json_round_trips():
    v = derive("demo", [node("a", age=50)], NOW)
    text = render(v)
    assert "FAILED (UNHEALTHY)" in text and "problem: no agent of this job reports any more" in text
    assert json.loads(json.dumps(_view().to_dict()))["members"][1]["state"] == "recovering"


def test_table_pads_columns():
    assert table([["a", "1"], ["bbb", "22"]], ["X", "Y"]).splitlines() == ["X    Y", "a    1", "bbb  22"]


def test_event_line_hides_bookkeeping_fields_and_shortens_long_values():
    line = format_event({"time": NOW, "node": "n", "kind": "hang", "fields": {"agent_pid": 3, "cause": "x" * 200}})
    assert "agent_pid" not in line and line.endswith("...") and len(line) < 120


def test_since_takes_durations_unix_and_iso_times():
    assert parse_since("90s", now=1000.0) == 910.0
    assert parse_since("2m", now=1000.0) == 880.0
    assert parse_since("1234.5") == 1234.5
    assert parse_since("1970-01-01T00:00:10+00:00") == 10.0
    assert parse_since(None) == 0.0
    with pytest.raises(ConfigError, match="--since 'yesterday'"):
        parse_since("yesterday")


def test_a_fatal_worker_error_fails_the_job_with_its_cause_whatever_the_nodes_last_said():
    v = derive("demo", [node("a", "recovering", step=8), node("b", step=8)], NOW,
                fatal="rank 1: checkpoint /c/step-8 does not match this job")
    text = render(v)
    assert text.startswith("run demo: FAILED (UNHEALTHY)")
    assert "problem: a worker error that restarting cannot fix ended the job: rank 1: checkpoint /c/step-8" in text


def test_restarts_line_shows_the_streak_without_progress_and_its_backoff():
    v = _view()
    v.restarts_used, v.no_progress_restarts, v.max_no_progress_restarts, v.backoff_s = 3, 2, 5, 1.1
    assert "restarts:   3 of 3 used; 2 in a row without progress (limit 5), backoff 1.1s" in render(v)
    v.no_progress_restarts = 0
    assert "restarts:   3 of 3 used\n" in render(v)


def test_status_shows_each_nodes_newest_snapshot_and_how_far_its_peer_replica_is():
    a, b, c = node("a", step=120), node("b", step=120), node("c", step=120)
    a.snapshot_step, a.replicated_step, a.replica_peer = 120, 119, "b"
    b.snapshot_step, b.replica_peer = 120, "c"  # nothing confirmed by its peer yet
    c.snapshot_step = 118  # alone in its ring view: local only
    text = render(derive("demo", [a, b, c], NOW))
    assert "snapshot:   a: step 120 in node RAM, replicated to b up to step 119" in text
    assert "snapshot:   b: step 120 in node RAM, not replicated yet (peer c)" in text
    assert "snapshot:   c: step 118 in node RAM, local only (no peer node)" in text
    assert "snapshot:" not in render(_view()), "no snapshot line when snapshots are off"


def test_status_names_the_rank_a_hang_started_at_and_the_stragglers():
    from elastictrain.agent.hang_attribution import attribute
    from elastictrain.agent.status import Event

    a, b = node("a", step=41), node("b", step=41)
    a.stragglers = {"3": {"step": 30, "lateness_s": 0.081, "score": 0.46}}
    v = derive("demo", [a, b], NOW)
    v.last_hang = attribute([
        Event(NOW - 8, "a", "hang", {"workers": [{"rank": 0, "local_rank": 0, "pid": 7, "step": 41,
                                                  "phase": "train", "silent_s": 5.2, "state": "sleeping"}]}),
        Event(NOW - 7, "b", "hang", {"workers": [{"rank": 1, "local_rank": 0, "pid": 9, "step": 41,
                                                  "phase": "train", "silent_s": 5.0, "state": "stopped"}]})])
    text = render(v)
    assert "last hang:  " in text and "rank 1 (node b, pid 9) stopped first at step 41 in phase 'train' " \
                                      "(process state 'stopped')" in text
    assert "straggler:  rank 3: 0.081s late per step (46% of the step time) since step 30" in text
    assert json.loads(json.dumps(v.to_dict()))["last_hang"]["rank"] == 1


def test_status_says_which_straggler_a_node_replaced_and_how_often_also_after_it_left():
    a, b = node("a", step=60), node("b", step=60)
    b.state = "left"  # drained as a straggler: its record stays
    b.stragglers_replaced = {"restart": 1, "drain": 1}
    b.last_replacement = {"slow_rank": 1, "action": "drain", "step": 52, "lateness_s": 0.151, "time": NOW - 5}
    text = render(derive("demo", [a, b], NOW))
    assert "replaced:   rank 1 on b (drain) at step 52, 0.151s late per step; this node so far: 1 drain, " \
           "1 restart" in text
    assert "replaced:" not in render(derive("demo", [node("a", step=60)], NOW)), "no line without a replacement"


def test_status_shows_the_ettr_where_the_time_went_and_what_the_last_faults_cost():
    from elastictrain.agent.ledger import compute

    log = [{"time": NOW - 100 + t, "node": n, "kind": k, "fields": f} for t, n, k, f in (
        (2, "a", "join", {}), (2, "b", "join", {}), (40, "b", "failure", {"cause": "rank 1: Signal 9 (SIGKILL)"}),
        (40.1, "b", "restart", {"reason": "failure"}), (44, "a", "join", {}), (44, "b", "join", {}),
        (46, "a", "checkpoint_loaded", {"step": 20}))]
    v = _view()
    v.ledger = compute(log, restarts=[{"time": NOW - 60, "step": 24}], started=NOW - 100, now=NOW,
                       current_step=40).to_dict()
    text = render(v)
    assert "ETTR:       " in text and "useful training of 100s wall time" in text
    assert "faults:     1, " in text and "4 step(s) recomputed" in text
    line = next(ln for ln in text.splitlines() if "worker failure: lost" in ln)
    assert "restart 4.0s, load 2.0s, recompute 4 step(s)" in line and "SIGKILL" in line


def test_a_recovery_in_place_shows_who_was_replaced_why_and_the_pause():
    v = derive("demo", [node("a", phase="paused"), node("b", phase="init")], NOW)
    v.in_place = {"time": NOW - 3, "node": "b", "reason": "node re-join", "generation": 4, "replaced_ranks": [1],
                  "lost_node": "old-b", "resumed": False, "pause_s": None, "step": None, "cause": None}
    text = render(v)
    assert text.startswith("run demo: RECOVERING")
    assert "in place:   PAUSED since" in text and "rank(s) 1 replaced by b, taking lost node old-b's place" in text
    v.in_place.update(resumed=True, pause_s=2.5, step=17, cause="a peer failed during step 17")
    assert "resumed at step 17 after 2.5s paused; a peer failed during step 17" in render(v)
    v.in_place.update(pause_parts={"wait": 2.0, "group": 0.1, "restore": 0.4})
    assert "after 2.5s paused (wait 2.00s, group 0.10s, restore 0.40s); a peer failed" in render(v)
