"""Helpers for checkpoint unit tests: real single-process DCP checkpoints in a temp directory."""

from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastictrain.checkpoint.commit import CommittingWriter
from elastictrain.checkpoint.manifest import CheckpointMetadata, step_dir_name
from elastictrain.checkpoint.storage import Storage, open_storage


def small_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(8, 8, generator=g), "b": torch.randn(8, generator=g)},
            "trainer": {"step": step, "samples": step * 16}}


def write_checkpoint(storage: Storage, step: int, fingerprint: dict | None = None) -> str:
    """A committed single-process checkpoint of `small_state(step)`; returns its directory name."""
    name = step_dir_name(step)
    writer = CommittingWriter(storage, name, CheckpointMetadata(step=step, world_size=1,
                                                                fingerprint=fingerprint or {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(small_state(step), storage_writer=writer, no_dist=True)
    return name


@pytest.fixture
def storage(tmp_path) -> Storage:
    return open_storage(str(tmp_path / "ckpts"))


@pytest.fixture
def make_checkpoint(storage) -> Callable[..., str]:
    return lambda step, **kw: write_checkpoint(storage, step, **kw)
