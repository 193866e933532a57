"""ReusedCpuStager: buffers prepared ahead of the first save (item 8 of issue #12), then reused by every save."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from elastictrain.checkpoint.staging import ReusedCpuStager, plain_state_dict


def _state(seed: int = 0, n: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, 4, generator=g), "step": torch.tensor(3.0)},
            "trainer": {"step": seed, "name": "x"}, "blob": b"rng"}


def _ptrs(staged: dict) -> list[int]:
    return [staged["model"]["w"].data_ptr(), staged["model"]["step"].data_ptr()]


def test_prepare_readies_buffers_that_every_save_then_copies_into():
    stager = ReusedCpuStager()
    assert not stager.ready
    stager.prepare(_state())
    first = stager.stage(_state(1))
    assert stager.ready
    assert torch.equal(first["model"]["w"], _state(1)["model"]["w"]) and first["trainer"] == {"step": 1, "name": "x"}
    second = stager.stage(_state(2))
    assert _ptrs(second) == _ptrs(first)
    assert torch.equal(second["model"]["w"], _state(2)["model"]["w"]) and second["blob"] == b"rng"
    stager.close()


def test_a_state_of_another_shape_gets_new_buffers_at_stage():
    stager = ReusedCpuStager()
    stager.prepare(_state())
    grown = stager.stage(_state(1, n=8))
    assert grown["model"]["w"].shape == (8, 4) and torch.equal(grown["model"]["w"], _state(1, n=8)["model"]["w"])
    stager.close()


def test_shared_memory_buffers_for_the_process_checkpointer():
    stager = ReusedCpuStager(share_memory=True)
    stager.prepare(_state())
    staged = stager.stage(_state(1))
    assert staged["model"]["w"].is_shared() and torch.equal(staged["model"]["w"], _state(1)["model"]["w"])
    stager.close()


def test_plain_state_dict_takes_the_state_of_stateful_objects():
    model = torch.nn.Linear(2, 3)
    plain = plain_state_dict({"model": model, "trainer": {"step": 1}})
    assert set(plain["model"]) == {"weight", "bias"} and plain["trainer"] == {"step": 1}


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_dtensor_buffers_keep_mesh_placements_and_global_shape(one_rank_group):
    src = distribute_tensor(torch.randn(6, 4), one_rank_group, [Shard(0)])
    stager = ReusedCpuStager()
    stager.prepare({"w": src})
    staged = stager.stage({"w": src})
    buf = staged["w"]
    assert isinstance(buf, DTensor) and buf.placements == src.placements and buf.shape == src.shape
    assert buf.to_local().data_ptr() != src.to_local().data_ptr()
    assert torch.equal(buf.to_local(), src.to_local())
    stager.close()
