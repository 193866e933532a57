"""`ElasticSampler`: the elastic data cursor over any map-style dataset, as the public API hands it to a user.

The global batch size stays fixed whatever the world size: a step is `global_batch_size / micro_batch_size`
micro-batches of one global sample order (runtime/cursor.py), dealt round-robin over the ranks. A rank with
fewer real micro-batches than the others runs padding ones (real indices, weight 0) so that every rank runs the
same forward/backward passes and collectives. Scaling each micro-batch's mean loss by `MicroBatch.weight` makes
the gradient, after FSDP's or DDP's average over ranks, the gradient of the global batch's mean loss: the same
at any world size up to summation order.

Its state is one number (samples consumed), saved in checkpoints through `TrainState`; the step loop advances it
after every step, so a resume at any world size consumes each sample exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch.distributed as dist

from elastictrain.errors import CheckpointMismatchError, ConfigError
from elastictrain.runtime.cursor import ElasticCursor, GlobalOrder


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of this rank's share of a step."""

    indices: list[int]
    """Dataset indices to load (for a padding micro-batch: real indices, whose loss counts for nothing)."""
    weight: float
    """Multiply the micro-batch's mean loss by this before `backward()`: world_size * micro / global, or 0."""
    fraction: float
    """This micro-batch's share of the global batch (micro / global, 0 for padding): `loss * fraction` summed
    over the step's micro-batches and ranks is the global batch's mean loss (see `Worker.report`)."""
    last: bool
    """The rank's last micro-batch of the step: where gradients are synchronised (FSDP2's
    `set_requires_gradient_sync(mb.last)`, DDP's `no_sync()` on the others)."""

    @property
    def padding(self) -> bool:
        return self.weight == 0.0


class ElasticSampler(ElasticCursor):
    """Which samples each rank trains on at each step, exactly once across restarts and world-size changes.

        sampler = ElasticSampler(len(dataset), global_batch_size=64, micro_batch_size=8, seed=0)
        for step in worker.steps(1000, state):          # state = TrainState(..., data=sampler)
            for mb in sampler.micro_batches():
                batch = collate([dataset[i] for i in mb.indices])
                (loss_fn(model(batch)) * mb.weight).backward()
    """

    def __init__(self, num_samples: int, *, global_batch_size: int, micro_batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        if num_samples <= 0:
            raise ConfigError(f"ElasticSampler: num_samples must be > 0, got {num_samples}")
        if micro_batch_size <= 0 or global_batch_size <= 0 or global_batch_size % micro_batch_size:
            raise ConfigError(f"ElasticSampler: global_batch_size ({global_batch_size}) must be a positive multiple "
                             f"of micro_batch_size ({micro_batch_size})")
        super().__init__(GlobalOrder(num_samples, seed, shuffle), global_batch_size, micro_batch_size)
        self.last_planned: list[int] = []
        """The real samples of this rank's most recent plan (what the sample ledger records for the step)."""

    def micro_batches(self, rank: Optional[int] = None, world_size: Optional[int] = None) -> list[MicroBatch]:
        """This rank's micro-batches of the current step (the sampler moves on only when the step loop ends it).

        `rank`/`world_size` default to the initialized process group's (rank 0 of 1 without one).
        """
        if rank is None or world_size is None:
            up = dist.is_available() and dist.is_initialized()
            rank = dist.get_rank() if up else 0
            world_size = dist.get_world_size() if up else 1
        plan = self.plan(0, rank, world_size)
        self.last_planned = plan.samples
        real = [s for s in plan.micro_batches if s is not None]
        fraction = self.micro_batch_size / self.global_batch_size
        weight = world_size * fraction
        # Padding repeats a real micro-batch of the step (rank 0's first): valid input of the usual shape.
        filler = list(real[0].samples) if real else list(self.order.lookup(
            range(self.samples_consumed, self.samples_consumed + self.micro_batch_size)))
        n = len(plan.micro_batches)
        return [MicroBatch(list(s.samples), weight, fraction, i == n - 1) if s is not None
                else MicroBatch(filler, 0.0, 0.0, i == n - 1)
                for i, s in enumerate(plan.micro_batches)]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "num_samples": self.order.num_samples, "seed": self.order.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The same position in another order is other samples: exactly-once would break without a word. Another
        # global batch size is fine (the position counts samples, not steps).
        mine = {"num_samples": self.order.num_samples, "seed": self.order.seed}
        differs = [f"{k} (checkpoint {state[k]}, now {v})" for k, v in mine.items() if k in state and state[k] != v]
        if differs:
            raise CheckpointMismatchError(f"the checkpoint's data sampler differs: {', '.join(differs)}; resume with "
                                          f"the same dataset and seed, or use a new checkpoint URL")
        super().load_state_dict(state)


def samplers_in(values: Sequence[Any]) -> list[ElasticSampler]:
    return [v for v in values if isinstance(v, ElasticSampler)]
