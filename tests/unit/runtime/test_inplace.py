"""The worker side of pause in place (runtime/inplace.py) in one process: which errors count as a peer's failure,
the settings the agent passes, and rebuilding the process group under a live FSDP2 model (the torch internals the
path depends on: a new default group takes the old one's name, the mesh resolves to it, FSDP's cached group and a
failed step's state are reset)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastictrain.runtime.inplace import (
    ENV_IN_PLACE,
    InPlaceSettings,
    abort_groups,
    init_placeholder,
    init_world,
    is_peer_failure,
    rebind_fsdp,
)
from elastictrain.runtime.train_state import prepare_for_load

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:50087: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the app.")


def test_a_dead_peers_collective_error_is_a_peer_failure_and_a_bug_in_the_step_is_not():
    assert is_peer_failure(RuntimeError(GLOO_RESET))
    assert is_peer_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4313"))
    assert is_peer_failure(dist.DistNetworkError("connect failed"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"))
    assert not is_peer_failure(ValueError("Connection reset by peer"))  # not from a collective
    assert not is_peer_failure(KeyboardInterrupt())


def test_settings_reach_the_worker_through_the_environment(monkeypatch):
    settings = InPlaceSettings("127.0.0.1:2379", "job1", {"lease_ttl": 5, "cacert": "/ca.pem"}, 12.5)
    monkeypatch.setenv(ENV_IN_PLACE, settings.to_env())
    assert InPlaceSettings.from_env() == settings
    monkeypatch.delenv(ENV_IN_PLACE)
    assert InPlaceSettings.from_env() is None


def _store(tmp_path, name: str) -> dist.Store:
    return dist.FileStore(str(tmp_path / name), 1)


@pytest.fixture
def world(tmp_path):
    timeout = datetime.timedelta(seconds=30)
    init_world(_store(tmp_path, "g0"), 0, 1, timeout, torch.device("cpu"))
    yield timeout
    if dist.is_initialized():
        dist.destroy_process_group()


def _model(mesh) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _step(model, optim, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def test_a_rebuilt_group_serves_the_same_mesh_and_fsdp_model_and_a_failed_step_leaves_nothing_behind(world, tmp_path):
    mesh = init_device_mesh("cpu", (1,))
    model = _model(mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = _model(init_device_mesh("cpu", (1,)))
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    _step(model, optim, 1)
    _step(reference, ref_optim, 1)
    # A step that fails half-way: forward done (the hooks ran), gradients of a backward left over, and what a
    # backward cut short before FSDP's reduce-scatter leaves on the unsharded parameters.
    model(torch.randn(4, 8)).pow(2).mean().backward()
    groups = [m._get_fsdp_state()._fsdp_param_groups[0] for m in (model[0], model[2])]
    for fp in (fp for g in groups for fp in g.fsdp_params):
        fp._unsharded_param.grad = torch.ones_like(fp._unsharded_param)
    old = dist.distributed_c10d._get_default_group()

    abort_groups()
    init_world(_store(tmp_path, "g1"), 0, 1, world, torch.device("cpu"))
    new = dist.distributed_c10d._get_default_group()
    assert new is not old and new.group_name == old.group_name, "the new group takes the first group's name"
    assert mesh.get_group(0) is new, "the mesh finds its group by name: the rebuilt one"
    assert rebind_fsdp(model) == 2, "one FSDP parameter group per layer (the root holds no parameters)"
    assert all(g.mesh_info.shard_process_group is new for g in groups)
    assert all(p.grad is None for p in model.parameters()), "the failed step's gradients are dropped"
    _step(model, optim, 2)
    _step(reference, ref_optim, 2)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine.full_tensor(), theirs.full_tensor()), "training on the rebuilt group diverged"


def test_a_joining_worker_builds_its_model_and_optimizer_state_before_its_group_exists_and_trains_the_same(tmp_path):
    """A replacement (a grow's new rank) prepares on a placeholder group, so that the others need not stop for its
    model build and first page touches: nothing reaches a peer from it (a collective raises), the state keeps its
    values, and once it trades the placeholder for the real group its model trains exactly like one built there."""
    init_placeholder(0, 1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = _model(mesh)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        with pytest.raises(RuntimeError, match="FakeProcessGroup collective operation error"):
            dist.all_reduce(torch.ones(1))
        before = [p.to_local().clone() for p in model.parameters()]
        touched = prepare_for_load(model, optim)
        assert touched == sum(t.numel() * 4 for t in before)
        assert all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters())), "values changed"
        assert {id(p) for p in optim.state} == {id(p) for p in model.parameters()}, "Adam's state not allocated"
        placeholder = dist.distributed_c10d._get_default_group()
        dist.destroy_process_group()
        init_world(_store(tmp_path, "g1"), 0, 1, datetime.timedelta(seconds=30), torch.device("cpu"))
        real = dist.distributed_c10d._get_default_group()
        assert real is not placeholder and mesh.get_group(0) is real, "the mesh finds the real group by its name"
        assert rebind_fsdp(model, reset=False) == 2
        reference = _model(init_device_mesh("cpu", (1,)))
        ref_optim = torch.optim.Adam(reference.parameters(), lr=0.1)
        for seed in (1, 2):
            _step(model, optim, seed)
            _step(reference, ref_optim, seed)
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            assert torch.equal(mine.full_tensor(), theirs.full_tensor()), "the joined model trained differently"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_grow_waits_for_a_durable_save_in_flight_but_not_longer_than_its_cap():
    """`_grow_now`, the flag each rank adds to the step's all_reduce: ready to re-form with a node that joins."""
    import time
    from types import SimpleNamespace

    from elastictrain.runtime.inplace import GROW_SAVE_WAIT_S
    from elastictrain.runtime.steps import StepLoop

    ip = SimpleNamespace(grow_ready=None, grow_ready_at=0.0, generation=3)
    saver = SimpleNamespace(saving=False)
    loop = SimpleNamespace(worker=SimpleNamespace(in_place=ip), checkpointer=saver)
    assert not StepLoop._grow_now(loop), "no node waits to join"
    ip.grow_ready, ip.grow_ready_at = 5, time.monotonic()
    assert StepLoop._grow_now(loop), "new workers ready, nothing in flight: re-form at this step"
    saver.saving = True
    assert not StepLoop._grow_now(loop), "a durable save in flight: the re-form would wait for it, so train on"
    ip.grow_ready_at = time.monotonic() - GROW_SAVE_WAIT_S - 1
    assert StepLoop._grow_now(loop), "the save has had its time: the joining node's workers wait no longer"
    loop.checkpointer = None
    assert StepLoop._grow_now(loop)
    ip.generation = 5
    assert not StepLoop._grow_now(loop) and ip.grow_ready is None, "already re-formed into that generation"
