"""ChaosRunner ordering and timing against an in-memory target (the faults themselves are tested elsewhere)."""

import json
import random
import threading
from typing import Optional

from elastictrain.chaos.runner import ChaosRunner, Injected, UnsupportedFault
from elastictrain.chaos.schedule import Schedule, ScheduledFault


class FakeClock:
    """A clock that advances only when the runner sleeps; the fake job makes one step per second."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class FakeTarget:
    """A job of named nodes that completes one step per fake second and ends at `end_step`."""

    def __init__(self, clock: FakeClock, nodes=("node0", "node1", "node2"), end_step: int = 1000,
                 unsupported=("partition",)) -> None:
        self.clock = clock
        self.live = list(nodes)
        self.end_step = end_step
        self.unsupported = unsupported
        self.log: list[tuple] = []

    def nodes(self) -> list[str]:
        return list(self.live)

    def step(self) -> Optional[int]:
        s = int(self.clock())
        return s if s >= 1 else None

    def finished(self) -> bool:
        return int(self.clock()) >= self.end_step

    def inject(self, fault: ScheduledFault, node: Optional[str], rng: random.Random) -> Injected:
        if fault.kind in self.unsupported:
            raise UnsupportedFault(f"{fault.kind} needs network namespaces")
        rank = fault.rank if fault.rank is not None else rng.randrange(4)
        self.log.append(("fire", fault.kind, node, rank, self.clock()))
        if fault.kind == "kill-node":
            self.live.remove(node)

        def heal() -> None:
            self.log.append(("heal", fault.kind, node, self.clock()))
            if fault.kind == "kill-node":
                self.live.append(node)

        return Injected(fault, node if fault.kind != "corrupt-checkpoint" else None, f"hit rank {rank}",
                        None if fault.heal_after is None else heal)


def run(text: str, seed: int = 0, **kw):
    clock = FakeClock()
    target = FakeTarget(clock, **{k: kw.pop(k) for k in ("end_step", "nodes") if k in kw})
    runner = ChaosRunner(Schedule.parse(text, seed=seed), target, clock=clock, sleep=clock.sleep, poll_s=0.1, **kw)
    return runner.run(), target, clock


def test_fires_in_order_at_step_and_time_and_heals_after_duration():
    records, target, clock = run("kill-worker@step=5, stop-worker:node1@t=8s/3s, kill-node:node2@step=9/2s")
    fires = [e for e in target.log if e[0] == "fire"]
    assert [(e[1], e[2]) for e in fires] == [("kill-worker", fires[0][2]), ("stop-worker", "node1"),
                                             ("kill-node", "node2")]
    assert fires[0][4] >= 5 and fires[1][4] >= 8 and fires[2][4] >= 9
    heals = {e[1]: e[3] for e in target.log if e[0] == "heal"}
    assert heals["stop-worker"] - fires[1][4] >= 3 - 1e-9
    assert heals["kill-node"] - fires[2][4] >= 2 - 1e-9
    assert "kill-worker" not in heals
    assert [r["fault"] for r in records] == ["kill-worker@step=5", "stop-worker:node1@t=8s/3s",
                                             "kill-node:node2@step=9/2s"]
    assert records[0]["fired_step"] >= 5 and records[0]["healed_at_s"] is None
    assert records[1]["node"] == "node1" and records[1]["healed_at_s"] >= records[1]["fired_at_s"] + 3 - 1e-9
    assert all(r["skipped"] is None for r in records)
    assert "node2" in target.live  # the killed node was started again before run() returned


def test_a_long_heal_does_not_hold_back_the_next_fault():
    records, target, _ = run("stop-worker:node0@t=1s/30s, kill-worker:node1@t=2s")
    assert [e[1] for e in target.log] == ["stop-worker", "kill-worker", "stop-worker"]
    assert records[1]["fired_at_s"] < 3 < records[0]["healed_at_s"]


def test_same_seed_same_node_and_rank_choices():
    text = ", ".join(f"kill-worker@t={i}s" for i in range(1, 12))
    a = [(e[2], e[3]) for e in run(text, seed=5)[1].log]
    b = [(e[2], e[3]) for e in run(text, seed=5)[1].log]
    c = [(e[2], e[3]) for e in run(text, seed=6)[1].log]
    assert a == b and a != c
    assert {n for n, _ in a} == {"node0", "node1", "node2"}


def test_unsupported_fault_is_skipped_with_reason_and_the_rest_runs():
    records, target, _ = run("partition:node1@t=1s/5s, kill-worker@t=2s")
    assert "network namespaces" in records[0]["skipped"] and records[0]["fired_at_s"] is None
    assert records[1]["skipped"] is None and [e[1] for e in target.log] == ["kill-worker"]


def test_job_finishing_skips_the_rest_and_heals_at_once():
    records, target, clock = run("stop-worker:node0@step=2/100s, kill-worker@step=50", end_step=10)
    assert records[1]["skipped"] == "the job finished first"
    assert records[0]["healed_at_s"] is not None and records[0]["healed_at_s"] < 20
    assert [e[0] for e in target.log] == ["fire", "heal"]


def test_timeout_skips_unfired_faults_and_heals_fired_ones():
    clock = FakeClock()
    target = FakeTarget(clock)
    runner = ChaosRunner(Schedule.parse("storage-stall@t=1s/100s, kill-worker@t=50s"), target, clock=clock,
                         sleep=clock.sleep, poll_s=0.5)
    records = runner.run(timeout=10)
    assert "timed out" in records[1]["skipped"]
    assert records[0]["healed_at_s"] is not None and records[0]["healed_at_s"] < 15


def test_min_gap_spaces_fires():
    records, _, _ = run("kill-worker@t=1s, kill-worker@t=1s, kill-worker@t=1s", min_gap_s=4.0)
    times = [r["fired_at_s"] for r in records]
    assert times[1] - times[0] >= 4 - 1e-9 and times[2] - times[1] >= 4 - 1e-9


def test_waits_for_a_live_node_instead_of_skipping():
    records, target, _ = run("kill-node:node0@t=1s/3s, kill-worker@t=1s", nodes=("node0",))
    assert records[1]["node"] == "node0" and records[1]["skipped"] is None
    assert records[1]["fired_at_s"] >= records[0]["healed_at_s"]


def test_event_log_has_one_json_record_per_fault(tmp_path):
    path = tmp_path / "events.jsonl"
    events = []
    records, _, _ = run("kill-worker@t=1s, stop-worker@t=2s/1s, partition@t=3s, corrupt-checkpoint@t=4s",
                        event_log=str(path), on_event=lambda what, r: events.append((what, r["fault"])))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert sorted(x["fault"] for x in lines) == sorted(r["fault"] for r in records)
    for line in lines:
        assert set(line) >= {"fault", "kind", "node", "detail", "fired_at_s", "fired_step", "healed_at_s", "skipped"}
    assert ("healed", "stop-worker@t=2s/1s") in events and ("skipped", "partition@t=3s") in events
    assert [w for w, f in events if f == "corrupt-checkpoint@t=4s"] == ["fired"]


def test_stop_event_ends_the_run_and_heals():
    clock = FakeClock()
    target = FakeTarget(clock)
    stop = threading.Event()

    def sleep(s: float) -> None:
        clock.sleep(s)
        if clock() > 5:
            stop.set()

    runner = ChaosRunner(Schedule.parse("stop-worker:node1@t=1s/60s, kill-worker@t=30s"), target, clock=clock,
                         sleep=sleep)
    records = runner.run(stop=stop)
    assert records[1]["skipped"] == "the chaos run was stopped"
    assert records[0]["healed_at_s"] < 10


def test_heal_failure_is_recorded_and_other_heals_still_run():
    clock = FakeClock()
    healed = []

    class HealFailsOnNode0(FakeTarget):
        def inject(self, fault, node, rng):
            def heal():
                if node == "node0":
                    raise OSError("mount busy")
                healed.append(node)
            return Injected(fault, node, "x", heal)

    schedule = Schedule.parse("stop-worker:node0@t=1s/2s, stop-worker:node1@t=1s/2s")
    runner = ChaosRunner(schedule, HealFailsOnNode0(clock), clock=clock, sleep=clock.sleep)
    records = runner.run()
    assert "mount busy" in records[0]["heal_error"] and healed == ["node1"]
