"""The worker session: rank info from torchrun's environment, the process group, the device mesh."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elastictrain.config import TrainConfig
from elastictrain.runtime.inplace import (
    InPlace,
    InPlaceFailed,
    abort_groups,
    init_placeholder,
    init_world,
    tracked_sockets,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    restart_count: int
    run_id: str

    @classmethod
    def from_env(cls) -> "RankInfo":
        """Read torchrun's variables; without them this is a one-process world (rank 0 of 1)."""
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            node_rank=int(env.get("GROUP_RANK", 0)),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            run_id=env.get("TORCHELASTIC_RUN_ID", "local"),
        )


def select_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from elastictrain.errors import ConfigError
            raise ConfigError("train.device=cuda but no CUDA device is visible; set train.device=cpu or auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class Session:
    """Owns the default process group and a 1-D device mesh over all ranks (FSDP's data-parallel dim)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.info = RankInfo.from_env()
        self.device = select_device(cfg.device, self.info.local_rank)
        self.mesh: Optional[DeviceMesh] = None
        self._tmp: Optional[tempfile.TemporaryDirectory] = None
        self.in_place = InPlace.from_env(self.info.rank, self.info.world_size)
        """Set when our agent runs the job with `elastic.in_place` (runtime/inplace.py)."""
        self.joining: Optional[int] = None
        """A replacement's generation while it prepares on a placeholder group, before it joins (`join`)."""

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def is_main(self) -> bool:
        return self.info.rank == 0

    def start(self) -> "Session":
        timeout = datetime.timedelta(seconds=self.cfg.collective_timeout_s)
        # CPU collectives (loss/flag reductions, DCP's group) always have gloo; CUDA tensors go through NCCL.
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            if self.in_place is not None and self.in_place.replacement:
                # A replacement for a failed rank: it joins the survivors' new group, not the first one.
                assert self.in_place.generation is not None
                place = self.in_place.place(self.in_place.generation)
                if place is not None and place != (self.rank, self.world_size):
                    # Started with its round rank: a node that took a shrunk round's place back (a grow in place).
                    self._move(*place)
                # The others wait for it (a replaced rank) or train on until it is ready (a grow): it builds its
                # model and optimizer on a placeholder group first, and joins at its step loop's start (`join`).
                init_placeholder(self.rank, self.world_size)
                self.joining = self.in_place.generation
                log.info("joining generation %d as rank %d of %d once the model is built (Worker.steps); until then "
                         "the process group is a placeholder: a collective raises 'FakeProcessGroup collective "
                         "operation error'", self.joining, self.rank, self.world_size)
            elif "MASTER_ADDR" in os.environ:
                with (tracked_sockets(self.in_place.service_ports())
                      if self.in_place is not None and self.device.type != "cuda" else contextlib.nullcontext()):
                    dist.init_process_group(backend=backend, timeout=timeout,
                                            device_id=self.device if self.device.type == "cuda" else None)
            else:
                # Plain `python -m ...`: a one-process group, so the code path is the same as under torchrun.
                self._tmp = tempfile.TemporaryDirectory(prefix="elastictrain-pg-")
                store = dist.FileStore(os.path.join(self._tmp.name, "store"), 1)
                dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("dp",))
        log.debug("session started: rank %d/%d on %s", self.rank, self.world_size, self.device)
        return self

    def join(self) -> bool:
        """A replacement prepared on its placeholder group (`start`): tell the others it is ready, and trade the
        placeholder for the generation's real group, which the mesh resolves to by name. False when not joining."""
        if self.joining is None:
            return False
        assert self.in_place is not None and self.mesh is not None
        generation, self.joining = self.joining, None
        self.in_place.mark_ready(generation)
        dist.destroy_process_group()
        self._init_generation(generation, keep_mesh=True)
        self.in_place.mark_entered(generation)
        return True

    def rebuild(self, generation: int, rank: Optional[int] = None, world_size: Optional[int] = None) -> bool:
        """Replace this process's groups by generation `generation`'s (the in-place path, runtime/inplace.py); with
        `rank`/`world_size` (a smaller world, rendezvous/shrink.py) under this rank in a world of that size, on a new
        device mesh. True when the mesh is new (a model sharded over the old one must be built again)."""
        assert self.in_place is not None and self.mesh is not None
        abort_groups()
        resized = world_size is not None and (world_size != self.world_size or rank != self.rank)
        if resized:
            assert rank is not None and world_size is not None
            self._move(rank, world_size)
        self._init_generation(generation, keep_mesh=not resized)
        if resized:
            self.mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("dp",))
        self.in_place.generation = generation
        return resized

    def _init_generation(self, generation: int, keep_mesh: bool) -> None:
        """This process's default group becomes generation `generation`'s; `keep_mesh`: the device mesh stays, so it
        must resolve to the new group (it finds its groups by name, and `init_world` reuses the first group's)."""
        assert self.in_place is not None and self.mesh is not None
        init_world(self.in_place.group_store(generation), self.rank, self.world_size,
                   datetime.timedelta(seconds=self.cfg.collective_timeout_s), self.device,
                   self.in_place.service_ports())
        if keep_mesh and self.mesh.get_group(0) is not dist.distributed_c10d._get_default_group():
            raise InPlaceFailed("the device mesh does not resolve to the new process group (a torch version whose "
                                "meshes keep their groups otherwise); restarting every worker instead")

    def _move(self, rank: int, world_size: int) -> None:
        """This process is rank `rank` of `world_size` from now on (a world that shrank or grew in place)."""
        assert self.in_place is not None
        self.info = dataclasses.replace(self.info, rank=rank, world_size=world_size)
        self.in_place.rank, self.in_place.world_size = rank, world_size
        # Code that reads torchrun's variables (torch's own helpers, the user's) sees the new world too.
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)

    def close(self) -> None:
        if self.in_place is not None:
            self.in_place.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
