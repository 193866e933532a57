"""The training state as DCP `Stateful` objects: what a checkpoint holds and how it is put back.

Keys: `model` and `optim` (sharded, reshardable, FQN-keyed through torch's state_dict helpers), `scheduler`,
`trainer` (step, data cursor, world size), and `rng/rank{r}` (this rank's RNG states; absent at another
world size, where RNG is re-derived from (seed, step, rank) instead).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


class ModelState(Stateful):
    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class CallbackState(Stateful):
    """Adapts a (get, set) pair to Stateful, for small plain-data state (trainer progress, RNG)."""

    def __init__(self, get: Callable[[], dict[str, Any]], put: Callable[[dict[str, Any]], None]):
        self._get, self._put = get, put

    def state_dict(self) -> dict[str, Any]:
        return self._get()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._put(state_dict)


def rng_key(rank: int) -> str:
    return f"rng/rank{rank}"
