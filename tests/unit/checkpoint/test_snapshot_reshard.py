"""Restoring snapshots at another world size (checkpoint/snapshot_reshard.py), in one process: which snapshot the
group can restore, the non-tensor values rebuilt as DCP's flattening names them, and a load of replicated (plain)
tensors. FSDP2 shards over real processes: tests/integration/checkpoint/test_snapshot_reshard.py."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from elastictrain.checkpoint.replica_wire import REPLICAS_DIR
from elastictrain.checkpoint.snapshot import SnapshotInfo, SnapshotStore, _leaves, read_layout, read_slot, storage_key
from elastictrain.checkpoint.snapshot_reshard import (
    Holding,
    Reshard,
    newest_complete,
    node_name,
    objects_for,
    read_shards,
    scan,
)
from tests.unit.checkpoint.test_snapshot import JOB, _same, _state, _train

TWO = {**JOB, "world_size": 2}


def _holding(node: str, path: str, rank: int, step: int, world: int = 2) -> Holding:
    return Holding(node, path, rank, world, SnapshotInfo(step, step % 2, 8, 0, {**JOB, "world_size": world}))


def test_the_newest_step_every_old_rank_is_held_for_is_chosen_own_folders_first():
    held = [_holding("a", "rank0", 0, 5), _holding("a", "rank0", 0, 6), _holding("b", "rank1", 1, 5),
            _holding("a", f"{REPLICAS_DIR}/b/rank1", 1, 5), _holding("a", f"{REPLICAS_DIR}/b/rank1", 1, 4)]
    chosen, why = newest_complete(held, world_size=1)
    assert chosen is not None and (chosen.step, chosen.world_size) == (5, 2) and not why
    assert [h.path for h in chosen.holders[1]] == ["rank1", f"{REPLICAS_DIR}/b/rank1"], "a replica may still change"
    assert newest_complete(held, world_size=2) == (None, ""), "the same world size restores in place instead"


def test_a_snapshot_missing_an_old_rank_is_not_chosen_and_the_reason_names_it():
    chosen, why = newest_complete([_holding("a", "rank0", 0, 7, world=3), _holding("a", "rank2", 2, 7, world=3)], 2)
    assert chosen is None and "world size 3 (step 7) lacks rank(s) 1" in why


def test_non_tensor_values_are_rebuilt_under_dcps_names():
    saved = {"optim": {"param_groups": [{"lr": 0.5, "betas": (0.9, 0.95), "params": ["w", "b"], "tags": []}]},
             "extra": {"grid": [[1, 2], [], [3]], "n": 4, "empty": []}}
    template = {"optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": ["?"], "tags": ["x"]}]},
                "extra": {"grid": [[0]], "n": 0, "empty": [7]}}
    flat, mappings = flatten_state_dict(template)
    got = objects_for(flat, mappings, list(_leaves(saved)))  # the leaves as a snapshot keeps them
    assert got == {"optim.param_groups.0.lr": 0.5, "optim.param_groups.0.betas": (0.9, 0.95),
                   "optim.param_groups.0.params": ["w", "b"], "optim.param_groups.0.tags": [],
                   "extra.grid": [[1, 2], [], [3]], "extra.n": 4, "extra.empty": []}


def test_a_snapshot_of_two_ranks_holding_plain_tensors_loads_at_one_from_one_of_them(tmp_path):
    """Replicated (non-DTensor) state, as two ranks of a data-parallel job hold it: each tensor is read once."""
    state, model, optim = _state(0)
    for _ in range(2):
        _train(state, model, optim)
    for rank in (0, 1):  # this node's rank 0 and its peer's rank 1, replicated here
        folder = tmp_path if rank == 0 else tmp_path / REPLICAS_DIR / "b"
        SnapshotStore(folder, rank, TWO).save(2, state.checkpoint_state(0))
    candidate, _ = newest_complete(scan(tmp_path, JOB), world_size=1)
    assert candidate is not None and candidate.step == 2
    shards = {r: read_shards(tmp_path, holders[0]) for r, holders in enumerate(candidate.holders)}
    fresh, _, _ = _state(9)
    reshard = Reshard(candidate, shards, fresh.checkpoint_state(0, for_load=True), tmp_path, node_name(tmp_path))
    try:
        assert reshard.plan() == {0}, "every tensor from one old rank: the lowest this node holds"
        reshard.obtain({0})
        reshard.load()
    finally:
        reshard.close()
    assert _same(fresh, state) and fresh.extras["scheduler"].last_epoch == 2


def _held_copy(monkeypatch):
    """Deferred copies wait until the returned event is set: a snapshot stays in flight while a test reads it."""
    from elastictrain.checkpoint import snapshot

    go, real = threading.Event(), snapshot._copy_into

    def copy_into(buf, copies, cancel=None):
        if copies and copies[0][3]:  # the deferred part, on the copy thread
            go.wait(10)
        real(buf, copies, cancel)

    monkeypatch.setattr(snapshot, "_copy_into", copy_into)
    return go


def _deferred(optim) -> frozenset:
    """What the step loop defers: the optimizer's parameters and state."""
    tensors = [p for group in optim.param_groups for p in group["params"]]
    return frozenset(storage_key(t) for t in tensors + [v for per in optim.state.values() for v in per.values()
                                                        if isinstance(v, torch.Tensor)])


def test_a_snapshot_in_flight_is_served_from_the_live_state_as_its_committed_slot_would_be(tmp_path, monkeypatch):
    """A grow in place reads the boundary's snapshot where its bytes are instead of waiting for its copy: every byte
    range, inside one tensor or across several, is what the committed slot holds; a cancelled copy commits nothing
    and raises nothing."""
    state, model, optim = _state(0)
    for _ in range(2):
        _train(state, model, optim)
    committed = SnapshotStore(tmp_path / "a", 0, JOB)
    committed.save(2, state.checkpoint_state(0))
    info = committed.available()[0][0]
    whole = read_slot(committed.dir, info)
    go = _held_copy(monkeypatch)
    store = SnapshotStore(tmp_path / "b", 0, JOB)
    assert store.save(2, state.checkpoint_state(0), later=_deferred(optim)) is None, "the copy must be in flight"
    live = store.live(cancel=True)
    assert live is not None and live.rank == 0 and (live.info.step, live.info.nbytes) == (2, info.nbytes)
    go.set()
    assert store.wait() is None and store.available() == ([], []), "a cancelled copy commits nothing"
    n = info.nbytes
    for a, b in [(0, n), (0, 1), (n - 3, n), (5, n // 2), (n // 3, n // 3 + 7), (n // 2, n // 2)]:
        assert torch.equal(live.slot[a:b], whole[a:b]), (a, b)
    layout = read_layout(store.dir, live.info)["layout"]  # written before the copy started
    for _, _, _, off, size in layout:
        assert torch.equal(live.slot[off:off + size], whole[off:off + size])


def _served_live(root, identity: dict, monkeypatch):
    """A 2-rank group's snapshot of step 2 under `root`: old rank 1's as a replica from node b, old rank 0's served
    from the live state (its copy cancelled, as at a grow). Returns the trained state and the live snapshot."""
    state, model, optim = _state(0)
    for _ in range(2):
        _train(state, model, optim)
    SnapshotStore(root / REPLICAS_DIR / "b", 1, identity).save(2, state.checkpoint_state(0))  # old rank 1, replicated
    go = _held_copy(monkeypatch)
    own = SnapshotStore(root, 0, identity)
    own.save(2, state.checkpoint_state(0), later=_deferred(optim))
    live = own.live(cancel=True)
    go.set()
    own.wait()
    assert live is not None and not own.available()[0], "the cancelled copy committed nothing"
    return state, live


def test_a_restore_at_another_world_size_loads_an_old_ranks_live_snapshot_and_no_one_else_reads_it(tmp_path,
                                                                                                  monkeypatch):
    state, live = _served_live(tmp_path, TWO, monkeypatch)
    holding = Holding(node_name(tmp_path), "rank0", 0, 2, live.info, live=True)
    candidate, _ = newest_complete(scan(tmp_path, JOB) + [holding], world_size=1)
    assert candidate is not None and candidate.step == 2 and candidate.holders[0] == (holding,)
    shards = {r: read_shards(tmp_path, holders[0]) for r, holders in enumerate(candidate.holders)}
    for served in (True, False):
        fresh, _, _ = _state(9)
        reshard = Reshard(candidate, shards, fresh.checkpoint_state(0, for_load=True), tmp_path,
                          node_name(tmp_path), live={0: live.slot} if served else None)
        try:
            assert reshard.plan() == {0}
            if not served:
                with pytest.raises(ValueError, match="held by another process's live state"):
                    reshard.obtain({0})
                continue
            reshard.obtain({0})
            reshard.load()
        finally:
            reshard.close()
        assert _same(fresh, state) and fresh.extras["scheduler"].last_epoch == 2


@pytest.mark.parametrize("workers_on_node", [1, 2])
def test_a_grow_takes_the_boundarys_snapshot_live_only_where_no_other_worker_of_the_node_reads_its_slot(
        tmp_path, monkeypatch, workers_on_node):
    """`hand_over(live=True)` at a grow: with one worker on the node, the copy in flight is cancelled and the
    snapshot handed over live (nothing committed for that step, the step before's snapshot kept); with two, another
    worker may need the slot's file, so the copy is waited for and committed as before."""
    from elastictrain.config import CheckpointConfig
    from elastictrain.runtime.checkpointing import StateCheckpointer
    from elastictrain.runtime.heartbeat import Heartbeat

    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(workers_on_node))
    state, model, optim = _state(0)
    ckpt = StateCheckpointer(CheckpointConfig(url=str(tmp_path / "ck"), snapshot_every_steps=1, storage_wait_s=0),
                             state, Heartbeat(None), rank=0, world_size=1, fingerprint={})
    _train(state, model, optim)
    ckpt.snapshot_if_due(final=False)
    ckpt._finish_snapshot()
    go = _held_copy(monkeypatch)
    _train(state, model, optim)
    ckpt.snapshot_if_due(final=False)
    assert ckpt.snapshots.in_flight
    store = ckpt.snapshots
    threading.Timer(0.5, go.set).start()  # the copy waits, as a big one would, until then
    live = ckpt.hand_over(live=True)
    steps = [i.step for i in store.available()[0]]
    if workers_on_node == 1:
        assert live is not None and live.info.step == 2 and steps == [1], "its copy cancelled: nothing committed"
    else:
        assert live is None and steps == [2, 1]
