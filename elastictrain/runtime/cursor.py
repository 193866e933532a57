"""The elastic data cursor: one global sample order, consumed exactly once whatever the world size.

The global order depends only on (seed, epoch). Optimizer step s consumes the `global_batch_size` positions
[s * G, (s + 1) * G) of that order, split into G / m micro-batches of m samples. Micro-batch i of a step goes
to rank i % W; every rank runs the same number of micro-batches (ceil((G / m) / W)), padding with empty
micro-batches (weight 0) so that collectives line up. The set of micro-batches of a step, and so the gradient
up to reduction order, is the same at any world size: changing W changes only who computes what.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from elastictrain.runtime.determinism import derive_seed


@dataclass(frozen=True)
class CursorSlice:
    """One micro-batch of a step: global sample positions and the dataset indices they map to."""

    index: int
    positions: tuple[int, ...]
    samples: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    """What one rank computes in one optimizer step. `None` entries are padding (zero-weight) micro-batches."""

    step: int
    rank: int
    world_size: int
    micro_batches: tuple[Optional[CursorSlice], ...]

    @property
    def samples(self) -> list[int]:
        return [s for mb in self.micro_batches if mb is not None for s in mb.samples]


class GlobalOrder:
    """Position k of the global stream -> dataset index, shuffled per epoch from (seed, epoch) only."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        if num_samples <= 0:
            raise ValueError("num_samples must be > 0")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = -1
        self._perm: Optional[np.ndarray] = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.Generator(np.random.PCG64(derive_seed(self.seed, "order", epoch)))
            self._perm = rng.permutation(self.num_samples)
            self._epoch = epoch
        assert self._perm is not None
        return self._perm

    def lookup(self, positions: range | list[int]) -> list[int]:
        out = []
        for k in positions:
            epoch, pos = divmod(k, self.num_samples)
            out.append(int(self._permutation(epoch)[pos]) if self.shuffle else pos)
        return out


class ElasticCursor:
    """Global cursor over a `GlobalOrder`; state is the number of samples consumed, nothing per rank."""

    def __init__(self, order: GlobalOrder, global_batch_size: int, micro_batch_size: int):
        if global_batch_size % micro_batch_size:
            raise ValueError("global_batch_size must be a multiple of micro_batch_size")
        self.order = order
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.samples_consumed = 0

    @property
    def micro_batches_per_step(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    @property
    def epoch(self) -> int:
        return self.samples_consumed // self.order.num_samples

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches each rank runs per step at this world size (padding included)."""
        return math.ceil(self.micro_batches_per_step / world_size)

    def plan(self, step: int, rank: int, world_size: int) -> StepPlan:
        """This rank's share of the next step (the cursor does not move until `advance`)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world size {world_size}")
        start, m = self.samples_consumed, self.micro_batch_size
        mine: list[Optional[CursorSlice]] = []
        for i in range(rank, self.micro_batches_per_step, world_size):
            positions = range(start + i * m, start + (i + 1) * m)
            mine.append(CursorSlice(i, tuple(positions), tuple(self.order.lookup(positions))))
        mine.extend([None] * (self.accumulation_steps(world_size) - len(mine)))
        return StepPlan(step=step, rank=rank, world_size=world_size, micro_batches=tuple(mine))

    def advance(self) -> None:
        self.samples_consumed += self.global_batch_size

    def state_dict(self) -> dict[str, int]:
        return {"samples_consumed": self.samples_consumed, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.samples_consumed = int(state["samples_consumed"])
