"""Pause in place (`elastic.in_place`) under a real 2-node `elastictrain run`: a SIGKILLed or stopped worker, or a
lost node started again, is replaced alone; the other node's worker keeps its process and state, waits at the step
boundary, rebuilds the process group with the replacement and continues from the newest in-memory snapshot; the job
ends bitwise-equal to an uninterrupted run. A lost node whose place is not held falls back to a restart."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import time

import psutil
import pytest

from elastictrain.agent.jobstate import event_dict
from elastictrain.agent.ledger import compute
from elastictrain.agent.snapshots import snapshot_base
from elastictrain.chaos.process_signals import drain_node, signal_worker
from elastictrain.runtime.audit import committed_timeline
from elastictrain.runtime.injected_faults import ENV_CHAOS
from elastictrain.runtime.inplace import GENERATIONS_PREFIX
from tests.chaos.cluster import STEPS, Job, Reference, expected_samples
from tests.chaos.test_agent_chaos import (
    FAULT_STEP,
    ON_TWO,
    WAIT_FOR_REJOIN,
    _etcd,
    assert_recovered,
    events,
    replay_on_one_rank,
    start_two,
)
from tests.chaos.test_snapshot_chaos import SNAPSHOTS
from tests.integration.recipe_runs import assert_same_train_state, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

IN_PLACE = (*SNAPSHOTS, "elastic.in_place=true", *WAIT_FOR_REJOIN)


@pytest.fixture
def in_place_job(tmp_path, etcd, run_id):
    j = Job(tmp_path, etcd.endpoint, run_id, extra_overrides=IN_PLACE)
    yield j
    j.teardown()


def test_a_killed_worker_a_stopped_worker_and_a_lost_node_are_replaced_alone(in_place_job, reference):
    """A worker SIGKILL, then a worker SIGSTOP (a hang: its agent kills and replaces it; the other node's agent sees
    its own worker silent but waiting, and gives the peer's agent time), then a node SIGKILL (agent and worker) and
    the same command again: the new node takes the lost node's place in the running round (its place is held for
    `elastic.rejoin_wait_s`) and its worker joins the survivor's next process-group generation. Each time the survivor
    keeps its process, only the victim is replaced, no new rendezvous round forms, at most one step is redone. The
    job ends bitwise-equal to an uninterrupted run, every sample consumed exactly once."""
    job = in_place_job
    a, b = start_two(job)
    survivor = job.wait_workers(a)
    saved = job.valid_checkpoints()
    reached = []
    for fault in (signal.SIGKILL, signal.SIGSTOP, "node"):
        victim = job.wait_workers(b)
        reached.append(job.max_step())
        if fault == "node":
            b.kill()
            b = job.start_node("b")
        else:
            signal_worker(b.pid, fault)
        job.wait_for_step(reached[-1] + 3, world_size=2)
        name = getattr(fault, "name", fault)
        assert job.wait_workers(a) == survivor, f"{name}: the survivor was restarted instead of pausing in place"
        assert job.wait_workers(b) != victim, f"{name}: the victim was not replaced"
        # The reporter drops the old group's store keys: a job of many faults does not pile them up in etcd.
        groups = _poll(lambda: _generations_in_etcd(job), lambda g: len(g) <= 1, timeout=10)
        assert len(groups) <= 1, f"{name}: store keys of more than the running group are left in etcd: {groups}"
    assert job.wait([a, b]) == [0, 0], job.logs()
    summary = assert_recovered(job, saved, ON_TWO)
    assert_same_train_state(summary, reference.summary)

    evs = events(job)
    replaced = [e for e in evs if e.kind == "restart" and e.fields.get("in_place")]
    assert [e.fields["replaced_ranks"] for e in replaced] == [[1], [1], [1]], [(e.kind, e.fields) for e in evs]
    assert replaced[-1].fields["reason"] == "node re-join", replaced[-1].fields
    assert not [e for e in evs if e.kind == "restart" and not e.fields.get("in_place")], \
        "a fault was recovered by restarting every worker instead of in place"
    resumed = [e for e in evs if e.kind == "in_place_resumed"]
    assert len(resumed) == 3, [(e.kind, e.fields) for e in evs]
    for e in resumed:  # where each pause went, as `status` shows it: the parts add up to no more than the pause
        parts = e.fields["parts"]
        assert {"wait", "group", "restore", "check"} <= set(parts) and all(v >= 0 for v in parts.values()), e.fields
        assert sum(parts.values()) <= e.fields["pause_s"] + 0.01, e.fields
    # The snapshot of the step before each fault (or the fault's own) is where both continue: at most one step redone
    # (for the lost node: the replica of its snapshot on the survivor's node).
    for e, r in zip(resumed, reached):
        assert e.fields["step"] >= r - 1, (e.fields, r)
    # Two joins of the first round, one of the node that took the lost one's place: no round was formed again.
    assert sum(1 for e in evs if e.kind == "join") == 3, \
        f"the agents re-formed the group instead of pausing in place\n{_dump(evs)}"
    assert [e for e in evs if e.kind == "hang"], "the stopped worker was not caught as hung"
    # The time ledger (status, dashboard, metrics) tells the same story: three faults, at most one step redone each.
    led = compute(evs, now=time.time(), final_step=summary["final_step"])
    dump = _dump(evs)
    assert [f.kind for f in led.faults] == ["worker failure", "hang", "node lost"], dump
    assert led.recomputed_steps <= 3, [f.to_dict() for f in led.faults]
    # The replacement took b's spare: its agent starts a new one for the next fault (here it declines: this short job
    # ends within the refill's minimum; benchmarks/scale.py's long jobs wait for the refilled spare).
    log = (job.out / "agent-b.log").read_text(errors="replace")
    first, second = [m.start() for m in re.finditer(r"replacing rank\(s\) 1 in place", log)][:2]
    assert re.search(r"refilling \d+ spare worker|not refilling spare workers: the job ends", log[first:second]), \
        "the agent did not consider refilling its spare after the in-place replacement"


def test_a_killed_rank_0_is_replaced_alone_and_the_surviving_rank_reports_the_recovery(in_place_job, reference):
    """Rank 0 reports the group's events, but a replaced rank 0 is a new process: it knows neither the pause nor the
    old generation. The lowest surviving rank reports the recovery instead. Seen in a goodput run: with rank 0 the
    victim nobody said the group resumed, so the time ledger kept the fault open until the next one (23.7 s charged
    for a 0.3 s pause), called the other node lost, and `status` said the recovery had not finished."""
    job = in_place_job
    a, b = start_two(job)
    victim, survivor = job.wait_workers(a), job.wait_workers(b)
    saved = job.valid_checkpoints()
    reached = job.max_step()
    signal_worker(a.pid, signal.SIGKILL)
    job.wait_for_step(reached + 3, world_size=2)
    assert job.wait_workers(b) == survivor, "the survivor was restarted instead of pausing in place"
    assert job.wait_workers(a) != victim, "the victim was not replaced"
    assert job.wait([a, b]) == [0, 0], job.logs()
    summary = assert_recovered(job, saved, ON_TWO)
    assert_same_train_state(summary, reference.summary)

    evs = events(job)
    dump = _dump(evs)
    replaced = [e for e in evs if e.kind == "restart" and e.fields.get("in_place")]
    assert [e.fields["replaced_ranks"] for e in replaced] == [[0]], dump
    resumed = [e for e in evs if e.kind == "in_place_resumed"]
    assert len(resumed) == 1 and resumed[0].node != replaced[0].node, f"no survivor reported the recovery\n{dump}"
    assert resumed[0].fields["step"] >= reached - 1 and resumed[0].fields["pause_s"] < 30, resumed[0].fields
    led = compute(evs, now=time.time(), final_step=summary["final_step"])
    assert [f.kind for f in led.faults] == ["worker failure"], dump
    fault = led.faults[0]
    assert fault.resumed_at is not None and fault.resumed_at <= resumed[0].time and fault.lost_s < 30, fault.to_dict()


def _generations_in_etcd(job: Job) -> set[str]:
    """The in-place groups (`g<n>`) that have store keys in etcd under the job's prefix."""
    client, prefix = _etcd(job)
    try:
        keys = client.get_prefix(f"{prefix}/{GENERATIONS_PREFIX}/")
    finally:
        client.close()
    heads = {k.removeprefix(f"{prefix}/{GENERATIONS_PREFIX}/").split("/", 1)[0] for k in keys}
    return {h for h in heads if re.fullmatch(r"g\d+", h)}


def _poll(read, done, timeout: float):
    """`read()` until `done(value)` or `timeout` seconds; the last value."""
    deadline = time.monotonic() + timeout
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.2)
        value = read()
    return value


def test_a_lost_node_whose_place_is_not_held_falls_back_to_a_restart_of_every_worker(tmp_path, etcd, run_id,
                                                                                   reference):
    """Without `elastic.rejoin_wait_s` nobody will take a lost node's ranks: the survivor gives up the in-place path
    as soon as the node's lease expires, and the agents restart every worker; the job (2:2) re-forms when the node is
    started again, and ends bitwise-equal to an uninterrupted run."""
    job = Job(tmp_path, etcd.endpoint, run_id, nnodes="2:2",
              extra_overrides=(*SNAPSHOTS, "elastic.in_place=true"))
    try:
        a, b = start_two(job)
        saved = job.valid_checkpoints()
        b.kill()
        b = job.start_node("b")
        assert job.wait([a, b]) == [0, 0], job.logs()
        summary = assert_recovered(job, saved, ON_TWO)
        assert_same_train_state(summary, reference.summary)
        evs = events(job)
        assert [e for e in evs if e.kind == "restart" and not e.fields.get("in_place")], \
            "the node loss did not fall back to a restart of every worker"
        assert not [e for e in evs if e.kind == "restart" and e.fields.get("in_place")], \
            "a lost node's rank was 'replaced in place' with no agent to start it"
    finally:
        job.teardown()


def test_a_smaller_world_renumbers_a_survivor_whose_worker_is_then_replaced_in_place(tmp_path, etcd, run_id):
    """3 nodes (1:3); the node of rank 0 (the first agent) SIGKILLed for good, its RAM with it, no place held: the
    others' agents drop it from the running round (no new round) and their workers, paused in place with their
    processes, go on as a world of 2, renumbered (rank 1 now 0, rank 2 now 1): they build the model on the new mesh
    (the recipe's `rebuild`) and load the 3-rank snapshot of the step before the kill, resharded (the lost rank's slot
    from its replica on a survivor's node). Then the worker of the node now rank 1 is SIGKILLed: its agent replaces it
    alone, with its new rank (the replacement's environment follows the shrink), and the survivors pause in place
    again. Neither survivor's agent ever restarts its workers, no round forms after the first, and every sample is
    consumed exactly once. (The grow and drain tests check a shrink in place bitwise against a replay.)"""
    job = Job(tmp_path, etcd.endpoint, run_id, nnodes="1:3", extra_overrides=(*SNAPSHOTS, "elastic.in_place=true"))
    try:
        nodes = [job.start_node(name) for name in "abc"]
        job.wait_for_step(FAULT_STEP, world_size=3)
        joins = [e for e in events(job) if e.kind == "join"]
        rank_of = {e.fields["agent_pid"]: e.fields["global_ranks"]["0"] for e in joins}
        by_rank = {rank_of[n.pid]: n for n in nodes}
        lost, first, last = by_rank[0], by_rank[1], by_rank[2]
        kept = job.wait_workers(first)
        saved = job.valid_checkpoints()
        reached = job.max_step()
        killed = time.time()
        lost.kill()
        for folder in snapshot_base().glob(f"*-{lost.pid}"):
            shutil.rmtree(folder)
        job.wait_for_step(reached + 2, world_size=2)
        victim = job.wait_workers(last)
        signal_worker(last.pid, signal.SIGKILL)
        assert job.wait([first, last]) == [0, 0], job.logs()
    finally:
        job.teardown()
    evs = events(job)
    dump = _dump(evs)
    shrinks = [e for e in evs if e.kind == "shrink"]
    assert {e.fields["agent_pid"] for e in shrinks} == {first.pid, last.pid}, dump
    assert {e.fields["world_size"] for e in shrinks} == {2}, dump
    assert {e.fields["agent_pid"]: e.fields["global_ranks"]["0"] for e in shrinks} == {first.pid: 0, last.pid: 1}, \
        dump
    # The dead agent's lease was revoked by a survivor's presence link, not waited out (lease_ttl 5 s here).
    assert "revoked its etcd lease" in first.log() + last.log(), job.logs()
    assert min(e.time for e in shrinks) - killed < 4.0, dump
    replaced = [e for e in evs if e.kind == "restart" and e.fields.get("in_place")]
    assert [e.fields["replaced_ranks"] for e in replaced] == [[1]], dump
    new_pids = set(replaced[0].fields["pids"].values())
    assert replaced[0].fields["agent_pid"] == last.pid and not set(victim.values()) & new_pids, dump
    # Workers start only at a join or a restart: the first survivor's one join started the process that finished.
    (joined,) = [e.fields["pids"] for e in evs if e.kind == "join" and e.fields["agent_pid"] == first.pid]
    assert list(joined.values()) == list(kept.values()), (joined, kept)
    assert not [e for e in evs if e.kind == "restart" and not e.fields.get("in_place")], dump
    assert sum(1 for e in evs if e.kind == "join") == 3, \
        f"a new round formed instead of going on in place\n{_dump(evs)}"
    resumed = [e for e in evs if e.kind == "in_place_resumed"]
    assert len(resumed) == 2 and resumed[0].fields["to_world_size"] == 2, dump
    assert resumed[0].fields["step"] >= reached - 1, dump
    start = resumed[0].fields["step"]
    loaded = [e for e in evs if e.kind == "checkpoint_snapshot_loaded" and e.fields.get("resharded_from") == 3]
    assert loaded and loaded[0].fields["step"] == start, dump
    sizes = {s: 3 if s < start else 2 for s in range(STEPS)}
    assert_recovered(job, saved, sizes)


def test_a_drained_node_leaves_a_smaller_world_in_place(tmp_path, etcd, run_id, reference):
    """Node b drained (SIGTERM to its agent: a scheduler's preemption, or `elastictrain drain`) in a 1:2 job: its
    agent records it gone from the running round before its worker stops; both workers stop at the same step boundary
    with the state saved, b's worker exits, and a's goes on in place as rank 0 of a world of 1 from that very step (no
    step recomputed, no re-form, no restart). Bitwise where 2 ranks up to that step, then 1, would end."""
    job = Job(tmp_path, etcd.endpoint, run_id, extra_overrides=(*SNAPSHOTS, "elastic.in_place=true"))
    try:
        a, b = start_two(job)
        survivor = job.wait_workers(a)
        saved = job.valid_checkpoints()
        drain_node(b.pid)
        assert job.wait([b]) == [0], "a drained node exits 0\n" + job.logs()
        assert job.wait([a]) == [0], job.logs()
    finally:
        job.teardown()
    evs = events(job)
    dump = _dump(evs)
    resumed = [e for e in evs if e.kind == "in_place_resumed"]
    assert len(resumed) == 1 and resumed[0].fields.get("to_world_size") == 1, dump
    start = resumed[0].fields["step"]
    assert start == resumed[0].fields["failed_step"], "a drain saves its step: nothing may be recomputed"
    assert [e.fields["reason"] for e in evs if e.kind == "shrink" and e.fields.get("recorded_here")] == \
        ["node drained"], dump
    assert not [e for e in evs if e.kind in ("restart", "reform")], \
        f"the survivor re-formed instead of going on\n{_dump(evs)}"
    assert sum(1 for e in evs if e.kind == "join") == 2, \
        f"a new round formed instead of shrinking in place\n{_dump(evs)}"
    # An agent starts workers only at a join or a restart: a's one join started the process that finished the job.
    (joined,) = [e.fields["pids"] for e in evs if e.kind == "join" and e.fields["agent_pid"] == a.pid]
    assert list(joined.values()) == list(survivor.values()), (joined, survivor)
    summary = assert_recovered(job, saved, {s: 2 if s < start else 1 for s in range(STEPS)})
    replay = replay_on_one_rank(job, reference, start, tmp_path / "replay")
    assert_same_train_state({**summary, "losses": {k: v for k, v in summary["losses"].items() if int(k) > start}},
                            replay)


def _dump(evs: list) -> str:
    """The job's events, one JSON line each: what a failed assertion shows (a CI run keeps nothing else)."""
    return "\n".join(json.dumps(event_dict(e)) for e in evs)


def _wait_for_event(job: Job, what, timeout: float = 90) -> list:
    start = time.monotonic()
    while True:
        evs = events(job)
        if any(what(e) for e in evs):
            return evs
        if time.monotonic() - start >= timeout:
            job.dump_stacks()  # where the stuck worker waits, in the agents' logs under the test's tmp_path
            raise AssertionError(_dump(evs))
        time.sleep(0.25)


def _start_with_a_slow_survivor(job: Job) -> tuple:
    """Nodes a and b at the fault step; a steps slowly from step 12, 2 s while it trains alone (the job does not end
    before a node started again is ready, also on a busy machine), 0.5 s in a world of 2 (the job does not end before
    the test's next fault); returns a, b and the checkpoints committed."""
    a = job.start_node("a", env={ENV_CHAOS: "slow@ms=2000,step=12,rank=0,world=1;slow@ms=500,step=12,rank=0,world=2"})
    b = job.start_node("b")
    job.wait_for_step(FAULT_STEP, world_size=2)
    job.wait_workers(b)
    return a, b, job.valid_checkpoints()


def _lose_for_good(job: Job, node) -> None:
    """SIGKILL `node` with its snapshots (a host lost), and wait until the survivor goes on alone in place."""
    node.kill()
    for folder in snapshot_base().glob(f"*-{node.pid}"):
        shutil.rmtree(folder)
    _wait_for_event(job, lambda e: e.kind == "in_place_resumed" and e.fields.get("to_world_size") == 1)


def test_a_node_started_after_a_worker_replacement_and_a_shrink_grows_the_world_back_in_place(
        tmp_path, etcd, run_id, reference):
    """goodput.py's schedule in a 1:2 job: b's worker SIGKILLed (replaced alone, in place), then node b (rank 1)
    SIGKILLed for good, its RAM with it: a goes on alone in place (a world of 1). Then b is started again: it takes its
    old place in the running round (no new round; this schedule once made the node that came back form a round of its
    own, world size 1, beside the survivor's: two jobs on the same checkpoints; its cause is pinned in
    rendezvous/test_in_place_shrink.py), its worker waits in the group's rendezvous, and a's worker, training
    meanwhile, stops at the next step boundary with that step's snapshot and re-forms a world of 2 with it, in place:
    a keeps its process, b's new worker copies its shards from a's node. Nothing is computed again, every sample is
    used once, and the job ends bitwise where "2 ranks, then 1, then 2 from the same steps" ends. (a alone steps
    slowly, so that the grow comes before the job's end; the next test covers a grow still pending at the end.)"""
    job = Job(tmp_path, etcd.endpoint, run_id, extra_overrides=(*SNAPSHOTS, "elastic.in_place=true"))
    try:
        a, b, saved = _start_with_a_slow_survivor(job)
        survivor = job.wait_workers(a)
        signal_worker(b.pid, signal.SIGKILL)
        _wait_for_event(job, lambda e: e.kind == "in_place_resumed")
        job.wait_workers(b)
        time.sleep(1.0)
        _lose_for_good(job, b)
        b = job.start_node("b")
        assert job.wait([a, b]) == [0, 0], job.logs()
        evs = events(job)
        dump = _dump(evs)
        resumed = [e for e in evs if e.kind == "in_place_resumed"]
        assert [(e.fields.get("from_world_size"), e.fields.get("to_world_size")) for e in resumed] == \
            [(None, None), (2, 1), (1, 2)], dump
        shrunk_at, grown = resumed[1].fields["step"], resumed[2]
        assert grown.fields.get("grew") and grown.fields["cause"] == "a node joined", dump
        assert grown.fields["step"] == grown.fields["failed_step"], f"steps were computed again after the grow\n{dump}"
        grows = [e for e in evs if e.kind == "grow"]
        assert {(e.fields["agent_pid"], e.fields["recorded_here"]) for e in grows} == {(b.pid, True), (a.pid, False)}, \
            dump
        assert all(e.fields["world_size"] == 2 for e in grows), dump
        assert not [e for e in evs if e.kind == "join" and e.fields["agent_pid"] == b.pid and
                    e.fields.get("world_size") == 1], f"the node that came back formed a round of its own\n{dump}"
        assert sum(1 for e in evs if e.kind == "join") == 3, \
            f"a new round formed instead of growing in place\n{dump}\n{job.logs()}"
        # The worker kill's replacement is a restart of that one rank, in place; nothing else restarted.
        assert [e.fields["replaced_ranks"] for e in evs if e.kind == "restart"] == [[1]] and \
            all(e.fields.get("in_place") for e in evs if e.kind == "restart"), \
            f"workers were restarted instead of re-forming in place\n{dump}"
        (joined,) = [e.fields["pids"] for e in evs if e.kind == "join" and e.fields["agent_pid"] == a.pid]
        assert list(joined.values()) == list(survivor.values()), (joined, survivor)
        # The snapshot of the step the group stopped at (the durable checkpoint instead when that step has one).
        loaded = [e for e in evs if e.kind in ("checkpoint_snapshot_loaded", "checkpoint_loaded")]
        assert loaded and loaded[-1].fields["step"] == grown.fields["step"], dump
        # ... read by a's worker from its own state, without waiting for that snapshot's copy (bitwise below).
        assert loaded[-1].fields.get("live_slots"), dump
        grew_at = grown.fields["step"]
        summary = assert_recovered(job, saved, {s: 2 if s < shrunk_at or s >= grew_at else 1 for s in range(STEPS)})
        ledger = compute(evs, now=time.time(), final_step=summary["final_step"])
        assert "node joined" in [f.kind for f in ledger.faults], (ledger.faults, dump)
        # Bitwise: the same history without faults (the in-place worker replacement is bitwise at the same world
        # size), from the reference's checkpoints.
        one = replay_on_one_rank(job, reference, shrunk_at, tmp_path / "one", stop_at=grew_at)
        two = tmp_path / "two"
        replay = run_recipe(two, 2, [*job.overrides, f"train.output_dir={two}", f"checkpoint.url={two}/ckpt",
                                     f"checkpoint.resume={Reference({}, one).checkpoint(grew_at)}"])
        assert_same_train_state({**summary, "losses": {k: v for k, v in summary["losses"].items()
                                                       if int(k) > grew_at}}, replay)
    finally:
        job.teardown()


def _assert_complete_once(job: Job, saved: set[int]) -> None:
    """The job reached its last step, every step consumed an uninterrupted run's samples once, no checkpoint lost."""
    summary = job.summary()
    assert summary["final_step"] == STEPS, summary
    assert committed_timeline(job.out / "samples") == {s: expected_samples(s) for s in range(STEPS)}, \
        "every step must consume exactly the samples of an uninterrupted run, once"
    assert not saved - job.valid_checkpoints(), "committed checkpoints were lost"


def test_the_only_survivor_failing_while_a_grow_is_pending_is_replaced_into_that_grow_in_place(tmp_path, etcd, run_id):
    """Node b lost for good (a goes on alone in place), then b started again: it takes b's place back, but its worker
    is not ready yet (SIGSTOPped here; a 50M model's build in goodput.py's schedule) when a's worker, the only one
    holding state, is SIGKILLed. A replacement in a newer generation stalled (b's worker waits in the grow's), and the
    restart of every worker that followed cost goodput.py's 50M job 7.2 s. Now a's agent starts the replacement in
    the grow's own generation: once b's worker goes on, the two form the world of 2 from a's snapshots, b's worker
    keeps its process, the grow is recorded formed (a later failure is replaced in place again), and the job ends
    complete, exactly-once, at world 2 from the step restored."""
    job = Job(tmp_path, etcd.endpoint, run_id, extra_overrides=(*SNAPSHOTS, "elastic.in_place=true"))
    try:
        a, b, saved = _start_with_a_slow_survivor(job)
        _lose_for_good(job, b)
        b = job.start_node("b")
        waiting = list(job.wait_workers(b).values())
        for pid in waiting:  # before they import torch, long before they are ready
            os.kill(pid, signal.SIGSTOP)
        evs = _wait_for_event(job, lambda e: e.kind == "grow" and e.fields["agent_pid"] == a.pid)  # a knows of it
        (grow,) = [e for e in evs if e.kind == "grow" and e.fields["agent_pid"] == a.pid]
        signal_worker(a.pid, signal.SIGKILL)
        _wait_for_event(job, lambda e: e.kind == "restart" and e.fields.get("into_grow"))
        for pid in waiting:
            os.kill(pid, signal.SIGCONT)
        assert job.wait([a, b], timeout=180) == [0, 0], job.logs()
        evs = events(job)
        dump = _dump(evs)
        restarts = [e for e in evs if e.kind == "restart"]
        assert [(e.fields["agent_pid"], e.fields.get("in_place"), e.fields["generation"], e.fields["replaced_ranks"])
                for e in restarts] == [(a.pid, True, grow.fields["generation"], [0])], \
            f"not one in-place replacement of a's rank into the grow's generation\n{dump}"
        assert "restarting every worker" not in (job.out / "agent-a.log").read_text(errors="replace")
        assert "had not joined the grow they were started for" not in b.log(), "b's waiting workers were stopped"
        assert "formed with the replacement of its only survivor" in (job.out / "agent-a.log").read_text(
            errors="replace"), "the grow was not recorded formed: a later failure would restart every worker"
        shrunk_at = next(e.fields["step"] for e in evs if e.kind == "in_place_resumed")
        loaded = [e for e in evs if e.kind in ("checkpoint_snapshot_loaded", "checkpoint_loaded")]
        grew_at = loaded[-1].fields["step"]  # the replacement's group, restored from a's snapshots
        assert loaded[-1].fields.get("resharded_from") == 1, dump
        assert_recovered(job, saved, {s: 2 if s < shrunk_at or s >= grew_at else 1 for s in range(STEPS)})
    finally:
        job.teardown()


def test_the_only_survivor_failing_after_it_entered_the_grows_group_restarts_every_worker(tmp_path, etcd, run_id):
    """As above, but b's worker is ready and a's worker has stopped to re-form the grow when it is SIGKILLed: the
    grow's group may already exist without it (seen in goodput.py at 50M: killed 2 s into the grow's restore, a
    replacement started into that generation found stale peers and stalled 31.7 s). a's agent must not replace it into
    the grow's generation then: every worker restarts (or, once the grow is recorded formed, a replacement goes into
    a newer generation); the job ends complete and exactly-once, no committed checkpoint lost."""
    job = Job(tmp_path, etcd.endpoint, run_id, extra_overrides=(*SNAPSHOTS, "elastic.in_place=true"))
    try:
        a, b, saved = _start_with_a_slow_survivor(job)
        _lose_for_good(job, b)
        b = job.start_node("b")
        deadline = time.monotonic() + 120
        while "re-forming a bigger world in place" not in (job.out / "agent-a.log").read_text(errors="replace"):
            assert time.monotonic() < deadline, job.logs()
            time.sleep(0.05)
        signal_worker(a.pid, signal.SIGKILL)
        assert job.wait([a, b], timeout=180) == [0, 0], job.logs()
        evs = events(job)
        dump = _dump(evs)
        assert not [e for e in evs if e.kind == "restart" and e.fields.get("into_grow")], \
            f"a's worker was replaced into a grow it had already entered\n{dump}"
        _assert_complete_once(job, saved)
    finally:
        job.teardown()


def test_the_job_finishing_before_a_pending_grow_re_forms_ends_every_node(tmp_path, etcd, run_id):
    """Node b lost for good (a goes on alone in place), then b started again: it takes b's place back, but its workers
    are not ready before a finishes the job (here they are SIGSTOPped before they can be). a's agent waits in the exit
    barrier for b, which had taken a place in the round, and b's workers wait for a group that never forms: this hung
    for the barrier's 300 s. Now a's agent records the job finished, and b's agent stops its workers and ends with it:
    both nodes exit 0, the job is complete and exactly-once."""
    job = Job(tmp_path, etcd.endpoint, run_id, extra_overrides=(*SNAPSHOTS, "elastic.in_place=true"))
    try:
        a, b, saved = _start_with_a_slow_survivor(job)
        _lose_for_good(job, b)
        b = job.start_node("b")
        for pid in job.wait_workers(b).values():  # before they import torch, long before they are ready
            os.kill(pid, signal.SIGSTOP)
        assert job.wait([a, b], timeout=120) == [0, 0], job.logs()
        evs = events(job)
        dump = _dump(evs)
        assert [e.kind for e in evs if e.fields.get("agent_pid") == b.pid and e.kind in ("grow", "grow_abandoned")] \
            == ["grow", "grow_abandoned"], dump
        resumed = [e for e in evs if e.kind == "in_place_resumed"]
        assert [e.fields.get("to_world_size") for e in resumed] == [1], dump
        shrunk_at = resumed[0].fields["step"]
        assert_recovered(job, saved, {s: 2 if s < shrunk_at else 1 for s in range(STEPS)})
    finally:
        job.teardown()


def test_a_survivor_blocked_on_a_frozen_lost_node_is_stopped_at_once(tmp_path, etcd, run_id):
    """Node b freezes (every process of it SIGSTOPped: its lease lapses, its connections stay open): a hung host. a's
    worker, blocked in a collective with b's frozen worker, neither fails nor pauses, so a's agent drops nothing in
    place and asks for a new round, and a graceful stop never reaches that worker (seen in scale.py at 50M, where the
    survivor's collective with a SIGKILLed node never failed: torch waited 30 s to SIGKILL it). a's agent now stops
    it at once (no progress since b was lost) and goes on alone: complete, exactly-once, no committed checkpoint
    lost. a steps slowly at world 2, so its own hang timeout does not act first."""
    job = Job(tmp_path, etcd.endpoint, run_id, extra_overrides=(*SNAPSHOTS, "elastic.in_place=true"))
    frozen: list[int] = []
    try:
        a = job.start_node("a", env={ENV_CHAOS: "slow@ms=1500,step=2,rank=0,world=2"})
        b = job.start_node("b")
        job.wait_for_step(FAULT_STEP, world_size=2)
        saved = job.valid_checkpoints()
        frozen = [b.pid, *(p.pid for p in psutil.Process(b.pid).children(recursive=True))]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        evs = _wait_for_event(job, lambda e: e.kind == "restart" and e.fields.get("stuck_on_lost_node"), timeout=60)
        assert all(e.fields.get("agent_pid") == a.pid for e in evs if e.fields.get("stuck_on_lost_node")), _dump(evs)
        for pid in frozen:  # the hung host goes away for good
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert job.wait([a], timeout=180) == [0], job.logs()
        assert "Unable to shutdown process" not in a.log(), "a's blocked worker waited out torch's graceful stop"
        _assert_complete_once(job, saved)
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.teardown()
