"""`checkpoint.snapshot_every_steps: auto`: every step when a snapshot costs at most 5% of a step, else the smallest
interval that keeps it there, measured over the first steps and the same on every rank."""

from __future__ import annotations

import pytest
import torch

from elastictrain import TrainState
from elastictrain.config import CheckpointConfig
from elastictrain.runtime.checkpointing import StateCheckpointer
from elastictrain.runtime.heartbeat import Heartbeat
from elastictrain.runtime.snapshot_pacing import BLOCK, PROBE_STEPS, SnapshotPacer, interval_for


@pytest.mark.parametrize("cost, step, interval", [(0.0, 1.0, 1), (0.05, 1.0, 1), (0.051, 1.0, 2), (0.2, 1.0, 4),
                                                  (0.34, 1.0, 7), (50.0, 1.0, 100), (-0.1, 1.0, 1)])
def test_the_interval_is_the_smallest_that_keeps_the_cost_at_most_5_percent(cost, step, interval):
    assert interval_for(cost, step) == interval


def _drive(pacer: SnapshotPacer, steps: int, plain_s: float, cost_s: float, tail_s: float = 0.0) -> list[int]:
    """Step boundaries on a fake clock: a step takes `plain_s`, plus `cost_s` after a snapshot, plus `tail_s` one
    step later (what the agent's replica of that snapshot, sent once its copy committed, takes from training)."""
    now, snapshots, extra, tail = [0.0], [], 0.0, 0.0
    pacer._clock = lambda: now[0]
    for step in range(1, steps + 1):
        now[0] += plain_s + extra
        snap = pacer.due(step)
        extra, tail = (cost_s if snap else 0.0) + tail, tail_s if snap else 0.0
        if snap:
            snapshots.append(step)
    return snapshots


def test_a_cheap_snapshot_is_taken_every_step_once_measured():
    pacer = SnapshotPacer("auto", agree=lambda n: n)
    snaps = _drive(pacer, PROBE_STEPS + 10, plain_s=1.0, cost_s=0.02)
    assert pacer.pace is not None and pacer.interval == 1
    assert [s for s in snaps if s <= PROBE_STEPS] == [s for s in range(1, PROBE_STEPS + 1) if (s // BLOCK) % 2], \
        "the probe alternates blocks of steps with and without snapshots"
    assert set(range(PROBE_STEPS + 2, PROBE_STEPS + 11)) <= set(snaps)


def test_a_costly_snapshot_is_spread_out_and_the_ranks_take_the_largest_interval():
    pacer = SnapshotPacer("auto", agree=lambda n: n)
    _drive(pacer, PROBE_STEPS + 4, plain_s=1.0, cost_s=0.34)  # 34% of a step: every 7th step costs 4.9%
    assert pacer.interval == 7 and abs(pacer.pace.cost_s - 0.34) < 1e-6 and pacer.pace.overhead <= 0.05
    slower_rank = SnapshotPacer("auto", agree=lambda n: max(n, 9))
    _drive(slower_rank, PROBE_STEPS + 4, plain_s=1.0, cost_s=0.34)
    assert slower_rank.interval == 9


def test_what_a_snapshot_costs_the_step_after_next_its_replica_is_counted_as_its_cost():
    """The copy costs 2% of the step after the snapshot and its replica 15% of the one after that. Every step, the
    job runs 17% slower; alternating single steps (the probe before) saw the replica in the plain steps and chose
    every step."""
    pacer = SnapshotPacer("auto", agree=lambda n: n)
    _drive(pacer, PROBE_STEPS + 4, plain_s=1.0, cost_s=0.02, tail_s=0.15)
    assert abs(pacer.pace.cost_s - 0.17) < 1e-6 and abs(pacer.pace.step_s - 1.0) < 1e-6
    assert pacer.interval == 4 and pacer.pace.overhead <= 0.05


def test_a_group_re_formed_in_place_keeps_the_interval_its_survivors_decided_and_probes_no_more():
    """The survivor's new checkpointer carries the pace; the replacement knows none: both take the survivor's at
    their first step (the one collective) and snapshot its steps from there; a group where nobody carries one probes."""
    agreed: list[int] = []

    def agree(n: int) -> int:
        agreed.append(n)
        return n

    before = SnapshotPacer("auto", agree=lambda n: n)
    _drive(before, PROBE_STEPS + 2, plain_s=1.0, cost_s=0.34)
    assert before.interval == 7
    survivor = SnapshotPacer("auto", agree=agree, carried=before.pace)
    replacement = SnapshotPacer("auto", agree=lambda n: max(n, 7))  # the survivor's value comes through the max
    steps = range(30, 45)
    assert [s for s in steps if survivor.due(s)] == [s for s in steps if replacement.due(s)] == [35, 42]
    assert agreed == [7] and survivor.carried_over and replacement.carried_over
    assert replacement.pace is not None and replacement.interval == 7
    fresh = SnapshotPacer("auto", agree=agree)
    snaps = _drive(fresh, BLOCK * 2, plain_s=1.0, cost_s=0.34)
    assert agreed == [7, 0] and fresh.pace is None and snaps == [s for s in range(1, BLOCK * 2 + 1) if (s // BLOCK) % 2]


def test_a_fixed_interval_is_kept_and_a_due_durable_save_gets_its_snapshot():
    pacer = SnapshotPacer(3, agree=lambda n: pytest.fail("a fixed interval needs no agreement"))
    assert [s for s in range(1, 10) if pacer.due(s, also=s == 4)] == [3, 4, 6, 9]


def test_auto_under_the_step_loop_snapshots_the_steps_it_chose(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT_DIR", str(tmp_path / "shm"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    optim = torch.optim.AdamW(model.parameters())
    state = TrainState(model=model, optim=optim)
    ckpt = StateCheckpointer(CheckpointConfig(url=str(tmp_path / "ck"), snapshot_every_steps="auto",
                                              storage_wait_s=0), state, Heartbeat(None), rank=0, world_size=1,
                             fingerprint={})
    events = []
    ckpt._emit = lambda name, fields: events.append((name, fields))
    taken = []
    try:
        for _ in range(PROBE_STEPS + 6):
            model(torch.randn(4, 64)).sum().backward()
            optim.step()
            optim.zero_grad()
            state.step += 1
            ckpt.snapshot_if_due(final=False)
            if ckpt.snapshots.in_flight or (ckpt.snapshots.last and ckpt.snapshots.last.step == state.step):
                taken.append(state.step)
    finally:
        ckpt.close()
    chosen = [f for n, f in events if n == "checkpoint_snapshot_interval"]
    assert len(chosen) == 1 and chosen[0]["interval"] >= 1, events
    interval = chosen[0]["interval"]
    after = [s for s in taken if s > PROBE_STEPS + 1]
    assert after == [s for s in range(PROBE_STEPS + 2, PROBE_STEPS + 7) if s % interval == 0]


def test_the_setting_takes_a_number_or_auto_and_names_both_when_wrong():
    from elastictrain.config import load_config
    from elastictrain.errors import ConfigError

    base = ["checkpoint.url=/tmp/ck"]
    assert load_config(None, [*base, "checkpoint.snapshot_every_steps=auto"]).checkpoint.snapshot_every_steps == "auto"
    with pytest.raises(ConfigError, match=r"checkpoint.snapshot_every_steps: expected int \| 'auto'"):
        load_config(None, [*base, "checkpoint.snapshot_every_steps=often"])
    with pytest.raises(ConfigError, match="checkpoint.snapshot_every_steps must be >= 0"):
        load_config(None, [*base, "checkpoint.snapshot_every_steps=-1"])
