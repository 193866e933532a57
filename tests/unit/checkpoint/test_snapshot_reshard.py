"""Restoring snapshots at another world size (checkpoint/snapshot_reshard.py), in one process: which snapshot the
group can restore, the non-tensor values rebuilt as DCP's flattening names them, and a load of replicated (plain)
tensors. FSDP2 shards over real processes: tests/integration/checkpoint/test_snapshot_reshard.py."""

from __future__ import annotations

from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from elastictrain.checkpoint.replica_wire import REPLICAS_DIR
from elastictrain.checkpoint.snapshot import SnapshotInfo, SnapshotStore, _leaves
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
