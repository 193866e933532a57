"""Chaos on a 2-node `elastictrain run` job on localhost with a real etcd: one fault per test, or two of a kind
where the first one's recovery leaves a job the second can hit just as well (one 2-node run instead of two).

Each test asserts the outcome, not timings: the job finishes (exit 0); every step of the committed history
consumed exactly the samples of an uninterrupted run (exactly once); every checkpoint that was valid before
the fault still is (keep_last is high, so retention removes none); every committed step ran at the world size the
test expects (sample ledger; the checkpoints' manifests must agree); and the final parameters, optimizer state and
losses are bitwise those of an uninterrupted run with that world-size history: the 2-node reference, or for the node
that finishes alone a replay (the reference's checkpoint of the step it resumed from, then 1 rank). Nothing is
compared with a tolerance: a world size other than the expected one fails the test instead.
"""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path

import pytest

from elastictrain.agent.budget import RestartBudget
from elastictrain.agent.hang_attribution import attribute
from elastictrain.agent.snapshots import snapshot_base
from elastictrain.agent.status import read_events
from elastictrain.chaos.process_signals import drain_node, signal_worker
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.settings import EtcdSettings
from elastictrain.runtime.audit import committed_timeline
from elastictrain.runtime.injected_faults import CHAOS_EXIT_CODE, ENV_CHAOS
from tests.chaos.cluster import STEPS, Job, Reference, expected_samples
from tests.integration.recipe_runs import assert_same_train_state, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FAULT_STEP = 9
SECOND_FAULT_STEP = 17
"""Past the re-formed group's first checkpoints (12, 16), so a second fault in the same job also lands mid-run."""
ON_TWO = {s: 2 for s in range(STEPS)}
WAIT_FOR_REJOIN = ("elastic.join_grace_s=60", "elastic.rejoin_wait_s=60")
"""The survivor waits (up to 60 s) for the node that left to come back, so every step runs on 2 ranks. With the
default (0) it goes on alone and the re-started node comes in by a scale-up: steps on 1 rank in between, when and
how many depending on the machine's speed."""


@pytest.fixture
def job(tmp_path, etcd, run_id):
    j = Job(tmp_path, etcd.endpoint, run_id)
    yield j
    j.teardown()


@pytest.fixture
def rejoin_job(tmp_path, etcd, run_id):
    j = Job(tmp_path, etcd.endpoint, run_id, extra_overrides=WAIT_FOR_REJOIN)
    yield j
    j.teardown()


def start_two(job: Job):
    a = job.start_node("a")
    b = job.start_node("b")
    job.wait_for_step(FAULT_STEP, world_size=2)
    return a, b


def assert_recovered(job: Job, saved_before: set[int], sizes: dict[int, int]) -> dict:
    """What every fault must leave, given the world size each step should have run at; returns the summary."""
    summary = job.summary()
    assert summary["final_step"] == STEPS and summary["world_size"] == sizes[STEPS - 1], summary
    assert committed_timeline(job.out / "samples") == {s: expected_samples(s) for s in range(STEPS)}, \
        "every step must consume exactly the samples of an uninterrupted run, once"
    lost = saved_before - job.valid_checkpoints()
    assert not lost, f"committed checkpoints lost or invalid after the fault: {sorted(lost)}"
    job.assert_world_sizes(sizes)
    return summary


def replay_on_one_rank(job: Job, reference: Reference, from_step: int, out: Path,
                       stop_at: int | None = None):
    """The history "2 ranks up to `from_step`, then 1" without faults: 1 rank resumed from the reference's
    checkpoint of `from_step` (plain torchrun, the job's config). The reference checkpoints every 4 steps; the state
    of a step in between comes from 2 ranks resumed from the checkpoint before it, stopped at that step (stop_at: the
    LR schedule still spans the job's steps). With `stop_at`, the 1 rank stops there too: its checkpoint folder."""
    resume = reference.checkpoint(from_step - from_step % 4)
    if from_step % 4:
        two = out / "two-ranks"
        run_recipe(two, 2, [*job.overrides, f"train.output_dir={two}", f"checkpoint.url={two}/ckpt",
                            f"checkpoint.resume={resume}", f"train.stop_at={from_step}"])
        resume = Reference({}, f"{two}/ckpt").checkpoint(from_step)
    summary = run_recipe(out, 1, [*job.overrides, f"train.output_dir={out}", f"checkpoint.url={out}/ckpt",
                                  f"checkpoint.resume={resume}", *([f"train.stop_at={stop_at}"] if stop_at else [])])
    return f"{out}/ckpt" if stop_at else summary


def _etcd(job: Job):
    settings = EtcdSettings.from_conf(job.endpoint, job.run_id, {})
    client = EtcdClient(settings)
    client.connect()
    return client, settings.run_prefix


def events(job: Job) -> list:
    client, prefix = _etcd(job)
    try:
        return read_events(client, prefix)
    finally:
        client.close()


def restarts_charged(job: Job) -> int:
    client, prefix = _etcd(job)
    try:
        return RestartBudget(client, prefix, max_restarts=job.max_restarts).used()
    finally:
        client.close()


def launch_seq(job: Job) -> int:
    """The newest launch (restart count) in the sample ledger: records of a later one come from a re-formed group."""
    return max(r["seq"] for r in job.records())


def launch_starts(job: Job) -> list[int]:
    """The first step each launch of the job ran, oldest launch first."""
    first: dict[int, int] = {}
    for r in job.records():
        first[r["seq"]] = min(first.get(r["seq"], r["step"]), r["step"])
    return [first[seq] for seq in sorted(first)]


def test_a_killed_then_a_stopped_worker_restart_the_group_and_it_ends_bitwise_identical(job, reference):
    """A worker SIGKILL (a failure), then, once the restarted group is past its next checkpoints, a worker SIGSTOP
    that an agent must call hung: each new group resumes from a checkpoint, and the job ends as if uninterrupted."""
    a, b = start_two(job)
    saved = job.valid_checkpoints()
    killed_in = launch_seq(job)
    signal_worker(b.pid, signal.SIGKILL)
    job.wait_for_step(SECOND_FAULT_STEP, world_size=2, after_seq=killed_in)
    stopped = signal_worker(b.pid, signal.SIGSTOP)
    assert job.wait([a, b]) == [0, 0], job.logs()
    summary = assert_recovered(job, saved, ON_TWO)
    assert_same_train_state(summary, reference.summary)
    starts = launch_starts(job)
    assert len(starts) >= 3 and all(s > 0 for s in starts[1:]), \
        f"each new group resumes from a checkpoint, not from scratch: launches started at steps {starts}"
    log = events(job)
    assert any(e.kind == "failure" for e in log)
    # Both agents may call their group hung in the same instant (the peer waits in a collective): the one that
    # owns the stopped worker must name it and its state.
    hangs = [e for e in log if e.kind == "hang"]
    assert any(str(stopped) in e.fields["cause"] and "stopped" in e.fields["cause"] for e in hangs), hangs
    culprit = attribute(log)  # what `status` says: every node's hang events read together
    assert culprit is not None and culprit.pid == stopped and culprit.state == "stopped", culprit


def test_a_node_sigkilled_then_one_drained_each_rejoin_by_the_same_command(rejoin_job, reference):
    """Node b SIGKILLed (agent and workers, no goodbye: its etcd lease expires) and started again; then, once the
    re-formed group is past its next checkpoints, the new b drained: it saves the step it stopped at, exits 0 without
    spending the restart budget, and is started again. Every step runs on 2 ranks."""
    job = rejoin_job
    a, b = start_two(job)
    saved = job.valid_checkpoints()
    killed_in = launch_seq(job)
    b.kill()
    b2 = job.start_node("b-rejoined")
    job.wait_for_step(SECOND_FAULT_STEP, world_size=2, after_seq=killed_in)
    before_drain, charged = job.valid_checkpoints(), restarts_charged(job)
    drain_node(b2.pid)
    assert job.wait([b2]) == [0], "a drained node exits 0\n" + job.logs()
    assert max(job.valid_checkpoints()) > max(before_drain), "the drain saves the step it stopped at"
    b3 = job.start_node("b-rejoined-again")
    assert job.wait([a, b3]) == [0, 0], job.logs()
    assert_same_train_state(assert_recovered(job, saved, ON_TWO), reference.summary)
    assert "drain" in [e.kind for e in events(job)]
    assert restarts_charged(job) == charged, "a drain must not spend the restart budget"


def test_first_agent_killed_the_other_node_finishes_alone_from_the_resharded_snapshot(job, reference, tmp_path):
    """Node a (the first agent, rank 0) SIGKILLed for good, its RAM with it: b re-forms alone, at world size 1, and
    resumes from the 2-rank in-memory snapshot (its own rank's slot and a's, replicated to b), resharded, at most
    one completed step before the kill; it ends bitwise where 2 ranks up to that step, then 1, would."""
    job.overrides.append("checkpoint.snapshot_every_steps=1")
    a, b = start_two(job)  # a started first: it formed the rendezvous and hosts rank 0
    saved = job.valid_checkpoints()
    reached = job.max_step()  # see test_snapshot_chaos: every rank, and b's replica of a, hold step reached - 1
    a.kill()
    for folder in snapshot_base().glob(f"*-{a.pid}"):
        shutil.rmtree(folder)  # the node's RAM is gone with it (on one machine the folder would outlive it)
    assert job.wait([b]) == [0], job.logs()
    summary = job.summary()
    resumed = summary["start_step"]
    assert summary["resumed_from"].startswith("snapshot:") and resumed >= reached - 1, (summary, reached)
    loaded = [e for e in events(job) if e.kind == "checkpoint_snapshot_loaded"]
    assert loaded and loaded[-1].fields["step"] == resumed and loaded[-1].fields["resharded_from"] == 2, loaded
    # Up to the step b resumed from, the 2-rank group's steps; from there on, b's alone.
    summary = assert_recovered(job, saved, {s: 2 if s < resumed else 1 for s in range(STEPS)})
    assert_same_train_state(summary, replay_on_one_rank(job, reference, resumed, tmp_path / "replay"))


def test_crash_loop_ends_the_job_with_a_clear_error(job):
    # Two failed restarts in a row make the loop (default 3: counting is RestartBudget's, tested in
    # tests/integration/agent_etcd/test_budget_status.py); one launch and one backoff fewer to wait for here.
    job.overrides.append("elastic.crash_loop_restarts=2")
    env = {ENV_CHAOS: f"crash@step={FAULT_STEP + 1},rank=1"}
    a = job.start_node("a", env)
    b = job.start_node("b", env)
    codes = job.wait([a, b])
    assert all(c != 0 for c in codes), job.logs()
    for node in (a, b):  # each node ends with the error, also one that finds the rendezvous closed
        final = [line for line in node.log().splitlines() if "crash loop" in line]
        # the cause is whichever node charged the round first: the crashed worker's exit or its peer's error; the
        # step is the newest one the agent heard of, and heartbeats are throttled (50 ms), so it may lag by one
        found = re.search(r"at step (\d+)\b", final[-1]) if final else None
        assert found and FAULT_STEP - 1 <= int(found.group(1)) <= FAULT_STEP + 1 \
            and "last cause: rank" in final[-1], f"{node.name} must end naming the loop and its step\n" + job.logs()
    assert job.max_step() == FAULT_STEP, "no step past the crashing one"
    codes = {f["exitcode"] for e in events(job) if e.kind == "failure" for f in e.fields.get("failures", [])}
    assert CHAOS_EXIT_CODE in codes, codes


LONE_STEPS = 8
"""Two checkpoints (4, 8): what a node that comes after the end finds is the final one."""


@pytest.fixture
def lone_job(tmp_path, etcd, run_id):
    """Nodes that each run alone: a join grace of 1 s, not 10 s, for a second node that is not coming."""
    j = Job(tmp_path, etcd.endpoint, run_id, steps=LONE_STEPS, extra_overrides=("elastic.join_grace_s=1",))
    yield j
    j.teardown()


def test_a_node_started_after_the_job_finished_exits_cleanly(lone_job):
    job = lone_job
    a = job.start_node("a")
    assert job.wait([a]) == [0], job.logs()
    late = job.start_node("late")  # e.g. a replacement a scheduler brought up as the job ended
    assert job.wait([late]) == [0], job.logs()
    # Depending on whether the last agent of the run is still leaving: a closed rendezvous of a run that
    # succeeded, or a fresh round that resumes from the final checkpoint and has nothing to train.
    assert "already finished on the other nodes" in late.log() or "nothing to train" in late.log(), late.log()
    assert job.summary()["final_step"] == LONE_STEPS
