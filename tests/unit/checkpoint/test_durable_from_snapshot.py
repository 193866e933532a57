"""Durable checkpoints written from in-memory snapshots (#14 item 3): the checkpoint holds exactly the state of its
step, training stages nothing for it (no second copy of the state), and the slot it reads is not rewritten while the
upload runs, so a crash meanwhile still finds the snapshot of the step before it."""

from __future__ import annotations

import torch.distributed.checkpoint as dcp

from elastictrain.checkpoint.snapshot import SnapshotStore
from elastictrain.config import CheckpointConfig
from elastictrain.runtime.checkpointing import StateCheckpointer
from elastictrain.runtime.heartbeat import Heartbeat
from tests.unit.checkpoint.test_snapshot import JOB, _same, _state, _train


def test_a_held_slot_is_saved_as_its_step_and_is_not_rewritten_until_released(tmp_path):
    state, model, optim = _state(0)
    store = SnapshotStore(tmp_path / "shm", 0, JOB)
    _train(state, model, optim)
    store.save(state.step, state.checkpoint_state(0))
    at_one, _, _ = _state(0)
    _train(at_one, at_one.model, at_one.optim)
    info = store.last
    view = store.hold(info)
    before = (store.dir / f"slot{info.slot}.bin").read_bytes()
    for _ in range(4):  # the snapshots go on, over the two other slots
        _train(state, model, optim)
        store.save(state.step, state.checkpoint_state(0))
        steps = sorted(i.step for i in store.available()[0])
        # The held step stays, and so do the two newest (the one before a crash mid-copy, and the newest).
        assert steps == sorted({1, state.step - 1, state.step}), steps
    assert (store.dir / f"slot{info.slot}.bin").read_bytes() == before, "the held slot was rewritten"
    dcp.save(view, checkpoint_id=str(tmp_path / "ck1"), no_dist=True)
    fresh, _, _ = _state(5)
    loaded = fresh.checkpoint_state(0, for_load=True)
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ck1"), no_dist=True)
    assert _same(fresh, at_one), "the checkpoint written from the slot is not the state of step 1"
    store.release(info)
    for _ in range(3):
        _train(state, model, optim)
        store.save(state.step, state.checkpoint_state(0))
    assert 1 not in [i.step for i in store.available()[0]], "a released slot rotates again"
    store.close()


def test_durable_saves_come_from_the_snapshots_without_staging_and_hold_each_steps_state(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT_DIR", str(tmp_path / "shm"))
    state, model, optim = _state(0)
    cfg = CheckpointConfig(url=str(tmp_path / "ck"), snapshot_every_steps=1, every_steps=2, storage_wait_s=0,
                           keep_last=10)
    ckpt = StateCheckpointer(cfg, state, Heartbeat(None), rank=0, world_size=1, fingerprint={})
    events = []
    ckpt.mgr._on_event = lambda name, fields: events.append((name, fields))
    expected = {}
    try:
        for _ in range(6):
            _train(state, model, optim)
            ckpt.snapshot_if_due(final=False)
            ckpt.after_step(final=False, stopping=False)
            ckpt.mgr.wait()  # this test's steps are shorter than an upload: no save skipped for being in flight
            if state.step % 2 == 0:
                snap, _, _ = _state(0)
                for _ in range(state.step):
                    _train(snap, snap.model, snap.optim)
                expected[state.step] = snap
        ckpt.mgr.wait()
    finally:
        ckpt.close()
    saved = [f["step"] for n, f in events if n == "checkpoint_saved"]
    assert saved == [2, 4, 6], events
    assert ckpt.mgr._stager._cache is None, "a save from a snapshot must not stage a second copy of the state"
    for step, want in expected.items():
        fresh, _, _ = _state(7)
        loaded = fresh.checkpoint_state(0, for_load=True)
        dcp.load(loaded, checkpoint_id=str(tmp_path / "ck" / f"step-{step:08d}"), no_dist=True)
        assert _same(fresh, want), f"the durable checkpoint of step {step} is not that step's state"


def test_a_restart_at_a_step_with_both_tiers_loads_the_snapshot_and_counts_that_step_as_saved(tmp_path, monkeypatch):
    """The durable checkpoint of a step is written from that step's snapshot: the same state. The snapshot is read
    from memory (a grow in place at 50M paused 2.5 s with it, 5.4-7.8 s with the durable load), so it wins the tie;
    the step still counts as saved, so a stop right after the restart does not write it again."""
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT_DIR", str(tmp_path / "shm"))
    state, model, optim = _state(0)
    cfg = CheckpointConfig(url=str(tmp_path / "ck"), snapshot_every_steps=1, every_steps=2, storage_wait_s=0,
                           keep_last=10)
    ckpt = StateCheckpointer(cfg, state, Heartbeat(None), rank=0, world_size=1, fingerprint={})
    try:
        for _ in range(4):
            _train(state, model, optim)
            ckpt.snapshot_if_due(final=False)
            ckpt.after_step(final=False, stopping=False)
            ckpt.mgr.wait()
    finally:
        ckpt.hand_over()  # as at a re-form in place: step 4's snapshot committed, its durable save written
    assert ckpt.mgr.newest_step() == 4

    fresh, _, _ = _state(7)
    again = StateCheckpointer(cfg, fresh, Heartbeat(None), rank=0, world_size=1, fingerprint={})
    events = []
    again._emit = lambda name, fields: events.append((name, fields))
    again.mgr._on_event = lambda name, fields: events.append((name, fields))
    try:
        resumed = again.restore()
        assert resumed is not None and resumed.source == "snapshot:step-4", resumed
        assert _same(fresh, state)
        assert ("checkpoint_snapshot_loaded", {"step": 4, "durable_step": 4}) in events, events
        again.save_now()  # an operator's "checkpoint now" right away: that step is saved already
        again.mgr.wait()
        assert not [f for n, f in events if n == "checkpoint_saved"], events
    finally:
        again.close()


def test_a_durable_save_due_where_the_group_re_forms_is_made_at_the_next_step_instead(tmp_path, monkeypatch):
    """A grow in place waits for every durable save in flight (its group is replaced); one that falls due at the
    grow's boundary would make the survivors wait for its whole write (6.4 s at 50M on 2 cores). It is deferred:
    the next step is saved, after the re-form, from that step's snapshot."""
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT_DIR", str(tmp_path / "shm"))
    state, model, optim = _state(0)
    cfg = CheckpointConfig(url=str(tmp_path / "ck"), snapshot_every_steps=1, every_steps=2, storage_wait_s=0,
                           keep_last=10)
    ckpt = StateCheckpointer(cfg, state, Heartbeat(None), rank=0, world_size=1, fingerprint={})
    for _ in range(2):
        _train(state, model, optim)
        ckpt.snapshot_if_due(final=False)
        owed = ckpt.after_step(final=False, stopping=False, regrouping=state.step == 2)
    assert owed and not ckpt.saving, "nothing in flight at the re-form: the save of step 2 is owed"
    ckpt.hand_over()
    assert ckpt.mgr.newest_step() is None

    after = StateCheckpointer(cfg, state, Heartbeat(None), rank=0, world_size=1, fingerprint={})
    try:
        _train(state, model, optim)
        after.snapshot_if_due(final=False)
        assert not after.after_step(final=False, stopping=False, owed=True)
    finally:
        after.hand_over()  # the snapshot's copy committed, the save written from it finished
    assert after.mgr.newest_step() == 3, "the owed save is made at the step after the re-form"
