"""In-memory snapshots (checkpoint/snapshot.py): a restore gives back exactly the saved state, a torn, corrupt or
foreign snapshot is never loaded, and a full /dev/shm turns snapshots off without stopping training."""

from __future__ import annotations

import errno
import json
import os
import platform
import subprocess

import pytest
import torch

from elastictrain import ElasticSampler, TrainState
from elastictrain.checkpoint.snapshot import SnapshotStore, _map_slot, _populate, read_slot
from elastictrain.checkpoint.snapshot_budget import PLAN_FILE
from elastictrain.config import CheckpointConfig
from elastictrain.errors import ConfigError
from elastictrain.runtime.checkpointing import StateCheckpointer
from elastictrain.runtime.heartbeat import Heartbeat

JOB = {"run": "r1", "fingerprint": {"model": "abc"}, "world_size": 1, "url": "file:///ck"}


def _state(seed: int) -> tuple[TrainState, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5)
    sampler = ElasticSampler(100, global_batch_size=8, micro_batch_size=4)
    return TrainState(model=model, optim=optim, scheduler=sched, data=sampler), model, optim


def _train(state: TrainState, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    optim.zero_grad()
    state.extras["scheduler"].step()
    state.extras["data"].advance()
    state.step += 1


def _same(a: TrainState, b: TrainState) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    oa, ob = a.optim.state_dict(), b.optim.state_dict()
    return (all(torch.equal(sa[k], sb[k]) for k in sa)
            and all(torch.equal(oa["state"][i][k], ob["state"][i][k]) for i in oa["state"] for k in oa["state"][i])
            and oa["param_groups"] == ob["param_groups"] and a.step == b.step
            and a.extras["data"].samples_consumed == b.extras["data"].samples_consumed)


def test_a_restore_gives_back_each_of_the_two_newest_states_exactly(tmp_path):
    state, model, optim = _state(0)
    store = SnapshotStore(tmp_path, 0, JOB)
    _train(state, model, optim)
    store.save(state.step, state.checkpoint_state(0))
    after_one, _, _ = _state(0)
    _train(after_one, after_one.model, after_one.optim)
    _train(state, model, optim)
    store.save(state.step, state.checkpoint_state(0))
    available, why = store.available()
    assert [i.step for i in available] == [2, 1] and not why

    fresh, _, _ = _state(7)  # other initial weights: everything must come from the snapshot
    store.restore(available[0], fresh.checkpoint_state(0))
    assert _same(fresh, state)
    other, _, _ = _state(8)
    store.restore(available[1], other.checkpoint_state(0))
    assert _same(other, after_one) and other.extras["scheduler"].last_epoch == 1


def test_a_save_interrupted_mid_copy_leaves_the_previous_snapshot_committed(tmp_path):
    state, model, optim = _state(0)
    store = SnapshotStore(tmp_path, 0, JOB)
    for _ in range(2):
        _train(state, model, optim)
        store.save(state.step, state.checkpoint_state(0))
    # A crash in the next save: the older slot's marker is gone first, its bytes half-written.
    older = min(store.available()[0], key=lambda i: i.step)
    (tmp_path / "rank0" / f"slot{older.slot}.json").unlink()
    with open(tmp_path / "rank0" / f"slot{older.slot}.bin", "r+b") as f:
        f.write(b"\0" * 16)
    assert [i.step for i in store.available()[0]] == [2]
    fresh, _, _ = _state(5)
    store.restore(store.available()[0][0], fresh.checkpoint_state(0))
    assert _same(fresh, state)


def test_a_corrupt_snapshot_is_refused_and_leaves_the_state_untouched(tmp_path):
    state, model, optim = _state(0)
    store = SnapshotStore(tmp_path, 0, JOB)
    _train(state, model, optim)
    info = store.save(state.step, state.checkpoint_state(0))
    with open(tmp_path / "rank0" / f"slot{info.slot}.bin", "r+b") as f:
        f.seek(5)
        f.write(b"\x7f\x7f")
    fresh, fmodel, _ = _state(5)
    before = {k: v.clone() for k, v in fmodel.state_dict().items()}
    with pytest.raises(ValueError, match="corrupt"):
        store.restore(info, fresh.checkpoint_state(0))
    assert all(torch.equal(before[k], v) for k, v in fmodel.state_dict().items()) and fresh.step == 0
    store.drop(info.step)
    assert store.available()[0] == []


def test_a_snapshot_of_another_job_or_world_size_is_never_offered_for_an_in_place_restore(tmp_path):
    """Another run, fingerprint or URL is another job; the same job at another world size is not (its snapshots are
    resharded, tests/integration/checkpoint/test_snapshot_reshard.py), but it is not this rank's shard either."""
    state, model, optim = _state(0)
    _train(state, model, optim)
    SnapshotStore(tmp_path, 0, JOB).save(1, state.checkpoint_state(0))
    for other in ({**JOB, "run": "r2"}, {**JOB, "url": "file:///other"}, {**JOB, "fingerprint": {"model": "xyz"}}):
        usable, why = SnapshotStore(tmp_path, 0, other).available()
        assert usable == [] and "belongs to another job" in why[0]
    assert SnapshotStore(tmp_path, 0, {**JOB, "world_size": 2}).available() == ([], [])


def test_a_full_dev_shm_turns_snapshots_off_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT_DIR", str(tmp_path / "shm"))
    state, model, optim = _state(0)
    events = []
    ckpt = StateCheckpointer(CheckpointConfig(url=str(tmp_path / "ck"), snapshot_every_steps=1, storage_wait_s=0),
                             state, Heartbeat(None), rank=0, world_size=1, fingerprint={})
    ckpt._emit = lambda name, fields: events.append((name, fields))

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    _train(state, model, optim)
    ckpt.snapshot_if_due(final=False)
    assert ckpt.snapshots is None
    assert events and events[0][0] == "checkpoint_snapshot_failed" and "No space left" in events[0][1]["error"]
    _train(state, model, optim)
    ckpt.snapshot_if_due(final=False)  # no second attempt, no error
    ckpt.close()


def test_parameters_are_copied_during_the_next_step_and_its_optimizer_step_waits_for_the_copy(tmp_path, monkeypatch):
    """The snapshot overlaps the next step's forward/backward, yet holds exactly the state at the step it names
    (the model's and optimizer's state dicts are built once and reused: the values must still be today's)."""
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT_DIR", str(tmp_path / "shm"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(6)))  # 25 MB (+50 MB of Adam state)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = TrainState(model=model, optim=optim)
    ckpt = StateCheckpointer(CheckpointConfig(url=str(tmp_path / "ck"), snapshot_every_steps=1, storage_wait_s=0),
                             state, Heartbeat(None), rank=0, world_size=1, fingerprint={})
    try:
        for _ in range(2):
            model(torch.randn(2, 1024)).sum().backward()
            optim.step()
            optim.zero_grad()
            state.step += 1
            optim.param_groups[0]["lr"] = 0.1 / state.step  # as a scheduler does, between snapshots
            expected = {k: v.clone() for k, v in model.state_dict().items()}
            expected_optim = {k: v.clone() for k, v in optim.state[next(model.parameters())].items()}
            ckpt.snapshot_if_due(final=False)
            assert ckpt.snapshots.in_flight, "parameters and optimizer state are copied off the training path"
            model(torch.randn(2, 1024)).sum().backward()  # the next step runs while the copy does
            optim.step()  # ...but its optimizer step waits for the copy before changing what it copies
            assert not ckpt.snapshots.in_flight
        newest = ckpt.snapshots.available()[0][0]
        assert newest.step == 2
        fresh = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(6)))
        fresh_state = TrainState(model=fresh, optim=torch.optim.AdamW(fresh.parameters(), lr=0.1))
        ckpt.snapshots.restore(newest, fresh_state.checkpoint_state(0))
        assert all(torch.equal(expected[k], v) for k, v in fresh.state_dict().items())
        restored = fresh_state.optim.state[next(fresh.parameters())]
        assert all(torch.equal(expected_optim[k], restored[k]) for k in expected_optim)
        assert fresh_state.optim.param_groups[0]["lr"] == 0.05, "the learning rate of the step the snapshot names"
    finally:
        ckpt.close()
    model(torch.randn(2, 1024)).sum().backward()
    optim.step()  # the hook is gone with the checkpointer


def test_snapshots_that_do_not_fit_the_memory_budget_stop_the_job_at_the_first_snapshot(tmp_path, monkeypatch):
    """Not a snapshot tier that fills /dev/shm halfway through a run: one clear, non-restartable error up front."""
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    state, model, optim = _state(0)
    ckpt = StateCheckpointer(CheckpointConfig(url=str(tmp_path / "ck"), snapshot_every_steps=1, storage_wait_s=0,
                                              snapshot_memory=1000), state, Heartbeat(None), rank=0, world_size=1,
                             fingerprint={})
    try:
        _train(state, model, optim)
        with pytest.raises(ConfigError, match="checkpoint.snapshot_memory") as err:
            ckpt.snapshot_if_due(final=False)
        assert not err.value.restartable and "snapshot_every_steps=0" in str(err.value)
        assert not list((tmp_path / "shm").rglob("slot*.bin")), "nothing reserved in node RAM"
    finally:
        ckpt.close()


def test_snapshots_that_do_not_fit_after_a_resume_wait_for_room_while_training_goes_on(tmp_path, monkeypatch):
    """A job that has trained is not stopped by the budget: after a restart or a re-form at a smaller world (each
    rank's share grew) snapshots that do not fit are skipped with one event, the durable tier goes on, and they are
    taken again once they fit. Seen at 150M: a survivor re-formed alone needed twice its share, and the job ended
    there; at the grow after it, the returning node found the survivor's slots of the smaller world not yet shrunk.
    Here another agent on the host (a live process) has planned more than the host has, then goes."""
    base = tmp_path / "elastictrain-snapshots"
    other = subprocess.Popen(["sleep", "60"])
    try:
        (base / f"job-{other.pid}").mkdir(parents=True)
        (base / f"job-{other.pid}" / PLAN_FILE).write_text(json.dumps({"needed": 1 << 60}))
        monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT_DIR", str(base / f"job-{os.getpid()}"))
        state, model, optim = _state(0)
        durable = StateCheckpointer(CheckpointConfig(url=str(tmp_path / "ck"), async_save=False), state,
                                    Heartbeat(None), rank=0, world_size=1, fingerprint={})
        _train(state, model, optim)
        durable.save_now()
        durable.close()
        state, model, optim = _state(1)
        ckpt = StateCheckpointer(CheckpointConfig(url=str(tmp_path / "ck"), snapshot_every_steps=1, storage_wait_s=0),
                                 state, Heartbeat(None), rank=0, world_size=1, fingerprint={})
        events = []
        ckpt._emit = lambda name, fields: events.append((name, fields))
        assert ckpt.restore() is not None and state.step == 1
        for _ in range(2):
            _train(state, model, optim)
            ckpt.snapshot_if_due(final=False)
        assert ckpt.snapshots is not None and ckpt.snapshots.last is None, "a snapshot that does not fit was taken"
        assert [name for name, _ in events] == ["checkpoint_snapshot_failed"], "one event per stretch without room"
        assert "other agents on this host plan" in events[0][1]["error"] and events[0][1]["retrying"]
        assert not list(base.rglob("slot*.bin")), "nothing reserved in node RAM"
        (base / f"job-{other.pid}" / PLAN_FILE).unlink()  # the other agent's slots went: room again
        _train(state, model, optim)
        ckpt.snapshot_if_due(final=False)
        ckpt.snapshots.wait()
        assert ckpt.snapshots.last.step == state.step == 4
        assert events[-1] == ("checkpoint_snapshot_resumed", {"step": 4, "since": 2})
        ckpt.close()
    finally:
        other.kill()
        other.wait()


def _two_snapshots_of_a_closed_store(tmp_path):
    """A state trained two steps, each snapshotted by a store that is then closed (a group before a re-form)."""
    state, model, optim = _state(0)
    first = SnapshotStore(tmp_path, 0, JOB)
    for _ in range(2):
        _train(state, model, optim)
        first.save(state.step, state.checkpoint_state(0))
    first.close()
    return state, model, optim


def test_after_a_re_form_the_next_slot_is_mapped_meanwhile_and_keeps_its_older_snapshot_until_rewritten(tmp_path):
    """A save that maps a slot anew (the first after a start or a re-form) has the other slot sized and mapped on a
    thread: the next save copies into pages already mapped (a grow one step later waits for that copy), and the
    older snapshot the other slot holds stays committed and exact until it is rewritten."""
    state, model, optim = _two_snapshots_of_a_closed_store(tmp_path)
    at_two, _, _ = _state(0)
    for _ in range(2):
        _train(at_two, at_two.model, at_two.optim)

    store = SnapshotStore(tmp_path, 0, JOB)  # the re-formed group's: nothing mapped yet
    _train(state, model, optim)
    third = store.save(state.step, state.checkpoint_state(0))
    store._prepared()
    other = 1 - third.slot
    prepared = store._buffers[other]
    assert prepared.numel() == third.nbytes, "the other slot was not mapped beside the save"
    older = next(i for i in store.available()[0] if i.step == 2)
    fresh, _, _ = _state(9)
    store.restore(older, fresh.checkpoint_state(0))
    assert _same(fresh, at_two), "mapping the slot ahead changed the snapshot it still holds"

    _train(state, model, optim)
    fourth = store.save(state.step, state.checkpoint_state(0))
    assert fourth.slot == other and store._buffers[other] is prepared, "the next save mapped its slot again"
    fresh, _, _ = _state(9)
    store.restore(fourth, fresh.checkpoint_state(0))
    assert _same(fresh, state)
    store.close()


def test_a_slot_mapped_ahead_beside_a_bigger_older_snapshot_is_cut_to_size_when_rewritten(tmp_path):
    """After a grow each rank's state is smaller: the slot mapped ahead keeps the bigger snapshot of the old world
    (committed, its checksum good) until a save rewrites it, and then holds no more than the new state."""
    big = SnapshotStore(tmp_path, 0, JOB)
    for step in (1, 2):
        big.save(step, {"w": torch.full((4096,), float(step))})
    big.close()
    store = SnapshotStore(tmp_path, 0, JOB)
    info = store.save(3, {"w": torch.ones(256)})
    store._prepared()
    rank_dir = tmp_path / "rank0"
    old = next(i for i in store.available()[0] if i.step == 2)
    assert read_slot(rank_dir, old).numel() == 4096 * 4, "the older, bigger snapshot was cut or damaged"
    again = store.save(4, {"w": torch.ones(256)})
    assert again.slot == old.slot and again.slot != info.slot
    sizes = {p.name: p.stat().st_size for p in rank_dir.glob("slot*.bin")}
    assert sizes == {f"slot{info.slot}.bin": 1024, f"slot{again.slot}.bin": 1024}, sizes
    store.close()


def test_mapping_a_slot_ahead_does_not_touch_its_bytes(tmp_path):
    path = tmp_path / "slot0.bin"
    buf = _map_slot(path, 1 << 20)
    buf[:8].copy_(torch.arange(8, dtype=torch.uint8))
    kernel = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    assert _populate(buf) or kernel < (5, 14), "MADV_POPULATE_WRITE refused on a kernel that has it"
    assert buf[:8].tolist() == list(range(8)) and int(buf[8:].sum()) == 0


def test_a_restored_state_has_both_slots_mapped_ahead_unless_the_budget_refuses(tmp_path):
    """After a restore (a re-form, a restart) the state's size is known: both slots are sized and mapped meanwhile,
    the snapshots they hold stay exact, and the first saves copy into those mappings. A budget that refuses the size
    now prepares nothing and raises nothing (the save reports it)."""
    state, model, optim = _two_snapshots_of_a_closed_store(tmp_path)

    refused = SnapshotStore(tmp_path, 0, JOB, check_room=lambda n: (_ for _ in ()).throw(ConfigError("no room")))
    refused.prepare(state.checkpoint_state(0))
    refused._prepared()
    assert refused._buffers == {}

    store = SnapshotStore(tmp_path, 0, JOB)
    fresh, _, _ = _state(9)
    store.restore(store.available()[0][0], fresh.checkpoint_state(0))
    store.prepare(fresh.checkpoint_state(0))
    store._prepared()
    mapped = dict(store._buffers)
    assert sorted(mapped) == [0, 1] and {b.numel() for b in mapped.values()} == {store.available()[0][0].nbytes}
    again, _, _ = _state(5)
    store.restore(store.available()[0][1], again.checkpoint_state(0))  # the older one too, untouched
    _train(fresh, fresh.model, fresh.optim)
    info = store.save(fresh.step, fresh.checkpoint_state(0))
    assert store._buffers[info.slot] is mapped[info.slot], "the first save after the restore mapped its slot again"
    store.close()
