"""Job state and health from hand-made NodeStatus records (elastictrain/agent/jobstate.py)."""

from elastictrain.agent.jobstate import derive
from elastictrain.agent.status import NodeStatus, WorkerStatus

NOW = 1_000_000.0


def node(name: str, state: str = "running", *, age: float = 1.0, since: float = NOW - 60, step: int = 100,
         phase: str = "train", restarts: int = 0) -> NodeStatus:
    return NodeStatus(node=name, host=f"host-{name}", agent_pid=1, state=state, group_rank=0, world_size=2,
                      workers=[WorkerStatus(local_rank=0, pid=10, step=step, phase=phase, heartbeat_age_s=0.5)],
                      step=step, step_time_s=0.2, restarts_used=restarts, max_restarts=3, last_event="join",
                      updated=NOW - age, state_since=since)


def test_fresh_running_nodes_make_a_healthy_running_job_at_the_newest_step():
    v = derive("r", [node("a", step=100), node("b", step=99)], NOW)
    assert (v.state, v.healthy, v.step) == ("running", True, 100)
    assert [m.state for m in v.members] == ["running", "running"]
    assert v.members[0].heartbeat_age_s == 1.5  # the worker's age when published + the record's age


def test_a_recovering_node_makes_the_job_recovering_and_unhealthy_only_after_the_limit():
    short = derive("r", [node("a"), node("b", "recovering", since=NOW - 5)], NOW, max_recovering_s=60)
    assert (short.state, short.healthy, short.since) == ("recovering", True, NOW - 5)
    long = derive("r", [node("a"), node("b", "rendezvous", since=NOW - 90)], NOW, max_recovering_s=60)
    assert (long.state, long.healthy) == ("recovering", False)
    assert "recovering for 90 s" in long.problems[0]


def test_a_silent_node_is_lost_and_unhealthy_until_the_others_reform_without_it():
    lost = derive("r", [node("a", since=NOW - 60), node("b", age=30)], NOW, stale_after_s=10)
    assert [m.state for m in lost.members] == ["running", "lost"]
    assert not lost.healthy and "node b (host-b) has not reported for 30 s" in lost.problems[0]
    # a joined again after b went silent: b is history
    gone = derive("r", [node("a", since=NOW - 5), node("b", age=30)], NOW, stale_after_s=10)
    assert [m.state for m in gone.members] == ["running", "gone"]
    assert gone.healthy and gone.state == "running"


def test_failed_budget_makes_the_job_failed():
    v = derive("r", [node("a", "failed"), node("b", "left", age=50)], NOW)
    assert (v.state, v.healthy) == ("failed", False)


def test_succeeded_nodes_make_a_finished_job_even_when_their_records_are_old():
    v = derive("r", [node("a", "succeeded", age=500), node("b", "succeeded", age=500)], NOW)
    assert (v.state, v.healthy) == ("finished", True)


def test_every_node_left_is_a_stopped_job_and_no_report_at_all_is_failed():
    assert derive("r", [node("a", "left", age=99)], NOW).state == "stopped"
    v = derive("r", [node("a", age=99), node("b", age=99)], NOW)
    assert (v.state, v.healthy) == ("failed", False)
    assert derive("r", [], NOW).state == "failed"


def test_pause_is_paused_once_every_worker_waits_and_pausing_before():
    both = derive("r", [node("a", phase="paused"), node("b", phase="paused")], NOW, pause_requested=True,
                  pause_since=NOW - 3)
    assert (both.state, both.since, both.healthy) == ("paused", NOW - 3, True)
    assert [m.state for m in both.members] == ["paused", "paused"]
    assert derive("r", [node("a", phase="paused"), node("b")], NOW, pause_requested=True).state == "pausing"


def test_a_fresh_job_is_starting_and_restarts_come_from_the_records():
    assert derive("r", [node("a", "starting"), node("b", "starting")], NOW).state == "starting"
    v = derive("r", [node("a", "starting", restarts=2), node("b", "starting", restarts=1)], NOW)
    assert (v.state, v.restarts_used, v.max_restarts) == ("recovering", 2, 3)


def test_joined_nodes_whose_workers_still_load_are_starting_first_and_recovering_after_a_restart():
    first = derive("r", [node("a", phase="init"), node("b", phase="load")], NOW)
    assert first.state == "starting" and [m.state for m in first.members] == ["loading", "loading"]
    again = derive("r", [node("a", phase="init", restarts=1), node("b", restarts=1)], NOW)
    assert again.state == "recovering"


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


class _FakeClient:
    def __init__(self, value: bytes):
        self.value = value

    def get(self, key):
        return (self.value, 1)


def test_rendezvous_state_is_read_without_running_foreign_pickles():
    import pickle

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    from elastictrain.agent.jobstate import read_rendezvous

    st = _RendezvousState()
    st.round, st.complete = 4, True
    st.participants = {_NodeDesc("h", 1, 0): 0, _NodeDesc("h", 2, 0): 1}
    got = read_rendezvous(_FakeClient(pickle.dumps(st)), "/p")
    assert (got.round, got.complete, got.participants, got.waiting) == (4, True, 2, 0)
    assert read_rendezvous(_FakeClient(pickle.dumps(_Evil())), "/p") is None


def test_progress_reports_become_loss_and_tokens_per_second_over_steps():
    from elastictrain.agent.jobstate import progress_series
    from elastictrain.agent.status import Event

    log = [Event(1.0, "a", "progress", {"step": 10, "loss": 4.5, "step_time_s": 0.5, "tokens": 2048}),
           Event(2.0, "a", "checkpoint_saved", {"step": 10}),
           Event(3.0, "a", "progress", {"step": 20, "loss": 3.9}),
           Event(4.0, "a", "progress", {"loss": 1.0})]  # no step: not a point
    assert progress_series(log) == [
        {"step": 10, "time": 1.0, "loss": 4.5, "step_time_s": 0.5, "tokens_per_s": 4096.0},
        {"step": 20, "time": 3.0, "loss": 3.9, "step_time_s": None, "tokens_per_s": None}]


def test_workers_paused_with_no_pause_requested_are_a_recovery_in_place_with_its_cause_and_length():
    from elastictrain.agent.jobstate import last_in_place
    from elastictrain.agent.status import Event

    v = derive("r", [node("a", phase="paused"), node("b", phase="init")], NOW)
    assert v.state == "recovering", "workers waiting in place for a replacement are not training"
    restart = Event(time=NOW - 3, node="b", kind="restart",
                    fields={"in_place": True, "reason": "node re-join", "generation": 4, "replaced_ranks": [1],
                            "lost_node": "old-b"})
    waiting = last_in_place([restart])
    assert waiting is not None and not waiting["resumed"] and waiting["replaced_ranks"] == [1]
    assert (waiting["reason"], waiting["lost_node"]) == ("node re-join", "old-b")
    resumed = Event(time=NOW - 1, node="a", kind="in_place_resumed",
                    fields={"generation": 4, "failed_step": 17, "step": 17, "pause_s": 2.5, "cause": "peer failed",
                            "parts": {"wait": 2.0, "group": 0.1, "restore": 0.4}})
    done = last_in_place([restart, resumed])
    assert done is not None and done["resumed"] and (done["pause_s"], done["step"]) == (2.5, 17)
    assert done["pause_parts"] == {"wait": 2.0, "group": 0.1, "restore": 0.4}, "where the pause went is lost"
    assert last_in_place([Event(time=NOW, node="a", kind="restart", fields={"reason": "failure"})]) is None
