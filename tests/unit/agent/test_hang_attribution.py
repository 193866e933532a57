"""Job-wide hang attribution from every node's hang events (elastictrain/agent/hang_attribution.py)."""

from elastictrain.agent.hang_attribution import attribute
from elastictrain.agent.status import Event


def hang(t: float, node: str, *workers: dict) -> Event:
    return Event(time=t, node=node, kind="hang", fields={"cause": "...", "workers": list(workers)})


def worker(rank: int, step: int, state: str = "sleeping", silent: float = 5.0, pid: int = 0) -> dict:
    return {"rank": rank, "local_rank": rank % 2, "pid": pid or 1000 + rank, "step": step, "phase": "train",
            "silent_s": silent, "state": state}


def test_the_stopped_process_is_the_culprit_whatever_the_other_nodes_saw_first():
    events = [Event(1.0, "a", "join", {}),
              hang(100.0, "a", worker(0, 41, silent=5.3), worker(1, 41, silent=5.2)),  # victims, seen first
              hang(100.4, "b", worker(2, 41, silent=5.1), worker(3, 41, state="stopped", silent=5.0, pid=4242))]
    c = attribute(events)
    assert (c.rank, c.node, c.pid, c.state, c.nodes) == (3, "b", 4242, "stopped", 2)
    assert "rank 3 (node b, pid 4242) stopped first at step 41" in c.describe() and "not running" in c.why


def test_without_a_stopped_process_the_rank_at_the_lowest_step_is_the_culprit():
    c = attribute([hang(50.0, "a", worker(0, 12), worker(1, 12)), hang(50.5, "b", worker(2, 11, silent=6.0))])
    assert c.rank == 2 and "lowest step" in c.why


def test_only_the_newest_incident_counts():
    old = hang(10.0, "b", worker(3, 5, state="stopped"))
    c = attribute([old, hang(100.0, "a", worker(0, 90, silent=7.0), worker(1, 90, silent=6.0))])
    assert c.rank == 0 and c.nodes == 1 and "silent longest" in c.why


def test_no_hang_no_culprit():
    assert attribute([Event(1.0, "a", "join", {}), Event(2.0, "a", "failure", {"cause": "x"})]) is None
