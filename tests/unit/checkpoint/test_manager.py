"""CheckpointManager in one process (no torch.distributed): the policy, not the multi-rank protocol."""

import logging
import os
import shutil
import threading
import time

import pytest
import torch

from elastictrain.checkpoint import commit
from elastictrain.checkpoint.discovery import find_latest_valid, list_checkpoints
from elastictrain.checkpoint.manager import CheckpointManager
from elastictrain.config import CheckpointConfig
from elastictrain.errors import CheckpointError, CheckpointMismatchError
from elastictrain.runtime.train_state import ModelState, OptimizerState

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
FP = {"model": "m1", "data": "d1", "seed": "s1"}


def make_state(seed=0, out=4):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, out)
    return model, {"model": model, "trainer": {"step": 0, "samples": 0}, "rng/rank0": torch.get_rng_state()}


def manager(tmp_path, events=None, fp=FP, **kw):
    cfg = CheckpointConfig(url=str(tmp_path / "ck"), **kw)
    return CheckpointManager(cfg, fingerprint=fp, on_event=(lambda n, f: events.append((n, f)))
                             if events is not None else None)


def test_should_save_every_n_steps_and_never_twice_for_a_step(tmp_path):
    m = manager(tmp_path, every_steps=3)
    assert [s for s in range(0, 10) if m.should_save(s)] == [3, 6, 9]
    _, state = make_state()
    m.save(3, state, blocking=True)
    assert not m.should_save(3)


def test_should_save_every_t_seconds(tmp_path):
    m = manager(tmp_path, every_seconds=0.2)
    assert not m.should_save(1)
    time.sleep(0.25)
    assert m.should_save(2)


def test_round_trip_restores_state_and_step_and_reports_missing_per_rank_keys(tmp_path):
    events = []
    m = manager(tmp_path, events, every_steps=1)
    model, state = make_state(1)
    state["trainer"].update(step=5, samples=80)
    m.save(5, state)
    m.close()
    assert [e[0] for e in events] == ["checkpoint_saved"]
    model2, state2 = make_state(2)
    state2["rng/rank1"] = torch.zeros(3)  # as on a larger world: not in the checkpoint
    loaded = manager(tmp_path, events).load_latest(state2)
    assert loaded.step == 5 and loaded.world_size == 1 and loaded.metadata.fingerprint == FP
    assert events[-1][0] == "checkpoint_loaded" and events[-1][1]["saved_world_size"] == 1
    assert loaded.missing_keys == ["rng/rank1"]
    assert state2["trainer"] == {"step": 5, "samples": 80}
    assert torch.equal(model2.weight, model.weight) and torch.equal(state2["rng/rank0"], state["rng/rank0"])


def test_async_save_snapshots_state_at_save_time(tmp_path):
    m = manager(tmp_path)
    model, state = make_state(3)
    before = model.weight.detach().clone()
    m.save(1, state)
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on while the upload runs
    m.wait()
    model2, state2 = make_state(4)
    manager(tmp_path).load_latest(state2)
    assert torch.equal(model2.weight, before)


def test_saved_event_counts_the_bytes_written_by_sync_and_async_saves(tmp_path):
    events = []
    m = manager(tmp_path, events)
    _, state = make_state()
    m.save(1, state, blocking=True)
    m.save(2, state)
    m.close()
    data = [os.path.getsize(tmp_path / "ck" / f"step-{s:08d}" / "__0_0.distcp") for s in (1, 2)]
    assert [(n, f["step"], f["bytes"]) for n, f in events] == [("checkpoint_saved", 1, data[0]),
                                                                ("checkpoint_saved", 2, data[1])]


def test_first_async_save_after_load_latest_allocates_no_staging_buffers(tmp_path, monkeypatch):
    """load_latest readies the staging buffers, so that the first save after a (re)start only copies (item 8:
    the first async save blocked 9.8 s against 0.15 s for the later ones, allocating them)."""
    m = manager(tmp_path)
    model, state = make_state()
    assert m.load_latest(state) is None
    m.should_save(1)  # a fresh start readies them after its first step, when every state exists
    training_thread, allocations, empty = threading.get_ident(), [], torch.empty

    def spy(*args, **kwargs):
        if threading.get_ident() == training_thread:
            allocations.append(args)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    m.save(1, state)
    monkeypatch.setattr(torch, "empty", empty)
    m.close()
    assert allocations == []
    _, state2 = make_state(5)
    manager(tmp_path).load_latest(state2)
    assert torch.equal(state2["model"].weight, model.weight)


def test_a_fresh_start_leaves_the_optimizer_untouched_until_its_first_step(tmp_path):
    """Readying staging buffers calls state_dict(); torch initialises an optimizer's missing state with a zero-lr
    step, which made AdamW count one step too many in every fresh run (bias correction off by one)."""
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {"model": ModelState(model), "optim": OptimizerState(model, optim)}
    m = manager(tmp_path)
    assert m.load_latest(state) is None
    assert optim.state == {}, "load_latest on a fresh start must not initialise the optimizer"
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    m.should_save(1)
    assert {int(s["step"]) for s in optim.state.values()} == {1}
    m.close()


def test_resume_never_and_resume_url(tmp_path):
    m = manager(tmp_path, every_steps=1)
    model, state = make_state(1)
    m.save(1, state, blocking=True)
    with torch.no_grad():
        model.weight.add_(1.0)
    m.save(2, state, blocking=True)
    assert manager(tmp_path, resume="never").load_latest(make_state()[1]) is None
    m1 = manager(tmp_path, resume=str(tmp_path / "ck" / "step-00000001"))
    model3, state3 = make_state(9)
    assert m1.load_latest(state3).step == 1
    assert torch.equal(model3.weight + 1.0, model.weight)
    with pytest.raises(CheckpointError, match="not a valid checkpoint"):
        os.remove(tmp_path / "ck" / "step-00000001" / "COMMITTED")
        manager(tmp_path, resume=str(tmp_path / "ck" / "step-00000001")).load_latest(state3)


def test_fingerprint_and_shape_mismatch_is_one_clear_error_naming_parts_and_keys(tmp_path):
    _, state = make_state()
    manager(tmp_path).save(1, state, blocking=True)
    _, other = make_state(out=6)
    with pytest.raises(CheckpointMismatchError) as e:
        manager(tmp_path, fp={**FP, "model": "m2"}).load_latest(other)
    msg = str(e.value)
    assert "model (checkpoint m1, this job m2)" in msg
    assert "model.weight: checkpoint (4, 4), model (6, 4)" in msg and "model.bias" in msg
    assert "Traceback" not in msg
    with pytest.raises(CheckpointMismatchError, match="not in the checkpoint: extra.x"):
        manager(tmp_path).load_latest({**make_state()[1], "extra": {"x": torch.zeros(1)}})


def test_library_version_difference_is_a_warning(tmp_path, monkeypatch, caplog):
    _, state = make_state()
    manager(tmp_path).save(1, state, blocking=True)
    import elastictrain.checkpoint.manager as mgr_mod
    monkeypatch.setattr(mgr_mod, "library_versions", lambda: {"torch": "0.0.1"})
    with caplog.at_level(logging.WARNING):
        loaded = manager(tmp_path).load_latest(make_state()[1])
    assert loaded.version_warnings and "torch" in loaded.version_warnings[0] and "other library versions" in caplog.text


def test_a_checkpoint_in_a_newer_format_is_refused_not_skipped_for_an_older_one(tmp_path, monkeypatch):
    """An older elastictrain resuming a newer one's checkpoints: a clear line with the fix, never a silent
    resume from an older checkpoint (the newer steps thrown away) or a misread."""
    _, state = make_state()
    m = manager(tmp_path)
    m.save(1, state, blocking=True)
    [saved] = list_checkpoints(m.storage)
    assert {"torch", "transformers", "peft", "elastictrain"} <= set(saved.manifest.metadata.versions)
    import elastictrain.checkpoint.manifest as manifest_mod
    monkeypatch.setattr(manifest_mod, "FORMAT_VERSION", 0)  # this reader predates the format written
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint format 1 .*reads format 0: upgrade elastictrain"):
        manager(tmp_path).load_latest(make_state()[1])


def test_failed_saves_never_raise_are_reported_and_retried_then_stop_after_the_limit(tmp_path, monkeypatch):
    events = []
    m = manager(tmp_path, events, max_consecutive_failures=2)
    _, state = make_state()
    broken = {"on": True}

    def disk_full(phase, rank, step):
        if phase == "before_data" and broken["on"]:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(commit, "PHASE_HOOK", disk_full)
    m.save(1, state)                    # async: failure surfaces when it completes
    assert m.save(2, state, blocking=True) is False
    assert [e[0] for e in events] == ["checkpoint_failed", "checkpoint_failed"]
    assert "no space left" in events[0][1]["error"] and events[1][1]["consecutive"] == 2
    with pytest.raises(CheckpointError, match="2 checkpoint saves in a row failed"):
        m.save(3, state)
    broken["on"] = False
    m2 = manager(tmp_path, events, max_consecutive_failures=2)
    m2.save(4, state, blocking=True)
    assert find_latest_valid(m2.storage).step == 4 and m2.consecutive_failures == 0


def test_failed_save_leaves_nothing_loadable_and_the_previous_checkpoint_is_used(tmp_path, monkeypatch):
    m = manager(tmp_path)
    model, state = make_state(1)
    m.save(1, state, blocking=True)
    w1 = model.weight.detach().clone()

    def die_before_marker(phase, rank, step):
        if phase == "after_manifest":
            raise OSError(5, "I/O error")

    monkeypatch.setattr(commit, "PHASE_HOOK", die_before_marker)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert m.save(2, state, blocking=True) is False
    monkeypatch.setattr(commit, "PHASE_HOOK", None)
    model2, state2 = make_state(2)
    assert manager(tmp_path).load_latest(state2).step == 1
    assert torch.equal(model2.weight, w1)


def test_storage_problem_at_startup_is_a_clear_storage_error(tmp_path):
    (tmp_path / "ck").write_text("a file where the directory should be")
    from elastictrain.errors import StorageError
    with pytest.raises(StorageError, match="not writable"):
        manager(tmp_path)
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_full_disk_at_startup_is_reported_and_training_can_go_on(tmp_path, monkeypatch):
    # e.g. a restart while the checkpoint volume is full: refusing to start would spend the restart budget
    events = []
    _, state = make_state()
    manager(tmp_path).save(1, state, blocking=True)
    import elastictrain.checkpoint.storage as storage_mod

    def full(self, data, rel):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage_mod.Storage, "write_bytes", full)
    m = manager(tmp_path, events)
    assert [e[0] for e in events] == ["checkpoint_storage_full"] and "no space left" in events[0][1]["error"]
    assert m.load_latest(make_state()[1]).step == 1  # the resume still reads


def test_unreachable_storage_at_startup_is_waited_for_then_a_clear_error(tmp_path, monkeypatch):
    import elastictrain.checkpoint.manager as mgr_mod
    from elastictrain.errors import StorageError, StorageUnreachableError

    outage = {"probes_left": 2}
    real_check = mgr_mod.check_storage

    def flaky(storage):
        if outage["probes_left"] > 0:
            outage["probes_left"] -= 1
            raise StorageUnreachableError("cannot write checkpoint storage s3://b/p: S3 endpoint x is unreachable")
        real_check(storage)

    slept: list[float] = []
    monkeypatch.setattr(mgr_mod, "check_storage", flaky)
    monkeypatch.setattr(mgr_mod.time, "sleep", slept.append)
    events = []
    manager(tmp_path, events, storage_wait_s=60)  # the outage passes: no error
    assert slept == [1.0, 2.0] and [e[0] for e in events] == ["checkpoint_storage_unreachable"]

    outage["probes_left"] = 10**6
    with pytest.raises(StorageError, match="unreachable.*waited 5 s, checkpoint.storage_wait_s"):
        manager(tmp_path, storage_wait_s=5)


def test_an_async_save_due_while_the_previous_one_uploads_is_skipped_and_the_next_one_commits(tmp_path, monkeypatch):
    """Training must not wait for storage: a stalled upload used to block the next save, and every step behind it."""
    events = []
    m = manager(tmp_path, events)
    _, state = make_state()
    release = threading.Event()
    monkeypatch.setattr(commit, "PHASE_HOOK",
                        lambda phase, rank, step: release.wait(30) if phase == "before_data" and step == 1 else None)
    m.save(1, state)
    t0 = time.monotonic()
    assert m.save(2, state) is False
    assert time.monotonic() - t0 < 5 and m.save_in_flight
    release.set()
    assert m.save(3, state, blocking=True) is True  # a blocking save (exit, operator) waits for the one in flight
    assert [(n, f["step"]) for n, f in events] == [("checkpoint_save_skipped", 2), ("checkpoint_saved", 1),
                                                   ("checkpoint_saved", 3)]
    assert events[0][1]["in_flight_step"] == 1 and events[0][1]["in_flight_s"] >= 0
    assert find_latest_valid(m.storage).step == 3
