"""The training state as DCP `Stateful` objects: what a checkpoint holds and how it is put back.

`TrainState` (public API) gathers them. Keys: `model` and `optim` (sharded, reshardable, FQN-keyed through
torch's state_dict helpers), each user extra under its own name (a scheduler, the `ElasticSampler`, any
`Stateful`), `trainer` (step, world size), and `rng/rank{r}` (this rank's RNG states; absent at another world
size, where RNG is re-derived from (seed, step, rank) instead). With `trainable_only`, `model` holds only the
parameters that require a gradient (and the buffers): a frozen base (LoRA, frozen layers) is not saved.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from elastictrain.checkpoint.snapshot import storage_key
from elastictrain.errors import CheckpointMismatchError, ConfigError
from elastictrain.runtime.determinism import capture_rng_state, restore_rng_state
from elastictrain.runtime.sampler import ElasticSampler


class ModelState(Stateful):
    """`trainable_only`: the parameters with requires_grad (and the buffers) only; a load leaves the frozen ones
    as they are, so the caller fills them (from pretrained weights, say) on every start."""

    def __init__(self, model: torch.nn.Module, trainable_only: bool = False):
        self.model, self.trainable_only = model, trainable_only

    def state_dict(self) -> dict[str, Any]:
        if not self.trainable_only:
            return get_model_state_dict(self.model)
        state = get_model_state_dict(self.model, options=StateDictOptions(ignore_frozen_params=True))
        # torch drops each frozen parameter under one of its names only: a tied one (lm_head.weight, the
        # embeddings' tensor) would stay.
        frozen = frozen_names(self.model)
        return {k: v for k, v in state.items() if k not in frozen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.trainable_only:
            set_model_state_dict(self.model, state_dict)
            return
        result = set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=False))
        frozen = frozen_names(self.model)
        missing = [k for k in result.missing_keys if k not in frozen]
        if missing or result.unexpected_keys:
            raise CheckpointMismatchError(f"the checkpoint's trainable parameters do not fit the model: missing "
                                          f"{missing[:8]}, unexpected {list(result.unexpected_keys)[:8]}; resume "
                                          f"with the model.lora / model.freeze settings it was written with")


def frozen_names(model: torch.nn.Module) -> set[str]:
    """The state-dict names (FQNs) of the parameters without requires_grad, every name of a tied one included."""
    return {fqn for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad
            for fqn in _get_fqns(model, name)}


class OptimizerState(Stateful):
    """`for_load`: the state dict is a destination for a load; a fresh Adam/AdamW gets zero state tensors to load
    into, where torch's helper would run a whole optimizer step over zero gradients to create them (seconds at 150M
    parameters on CPU, on every restart)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, for_load: bool = False):
        self.model, self.optimizer, self.for_load = model, optimizer, for_load

    def state_dict(self) -> dict[str, Any]:
        if self.for_load and not self.optimizer.state and isinstance(self.optimizer, torch.optim.Adam):
            _allocate_adam_state(self.optimizer)
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def prepare_for_load(model: Optional[torch.nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> int:
    """Make the memory a load fills exist now: Adam's state allocated (zeros, as `OptimizerState` would at the load)
    and every page of the model's CPU parameters written once (values kept: `mul_(1)`). A joining worker does this
    before the others stop for it, so that the first touch of fresh pages (the kernel zeroes each: 0.2-1 GB/s on a
    VM backed on first touch) is not part of their pause. Returns the bytes of parameters touched."""
    if isinstance(optimizer, torch.optim.Adam) and not optimizer.state:
        _allocate_adam_state(optimizer)
    touched = 0
    if model is None:
        return touched
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.device.type == "cpu" and local.is_floating_point() and local.numel():
                local.mul_(1)
                touched += local.numel() * local.element_size()
    return touched


def _allocate_adam_state(optimizer: torch.optim.Adam) -> None:
    """The state Adam's first step creates (torch/optim/adam.py `_init_group`), zeros: only ever loaded into."""
    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for p in group["params"]:
            if not p.requires_grad:
                continue
            step = torch.zeros((), dtype=torch.float32, device=p.device) if on_device else torch.tensor(0.0)
            state = {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state


class ReusedModelState(ModelState):
    """`ModelState` whose state dict is built by torch's helpers once and reused while it still holds the live
    tensors (its values share their memory, so in-place updates show through). torch's helpers resolve every
    parameter's name on each call (25 ms for a two-layer model, more with more parameters), which an every-step
    snapshot would otherwise pay every step. Only for reading: a load goes through a fresh `ModelState`."""

    def __init__(self, model: torch.nn.Module, trainable_only: bool = False):
        super().__init__(model, trainable_only)
        self._cached: Optional[dict[str, Any]] = None
        self._signature: tuple = ()

    def state_dict(self) -> dict[str, Any]:
        signature = tuple(storage_key(t) for t in (*self.model.parameters(), *self.model.buffers()))
        if self._cached is None or signature != self._signature:
            self._cached, self._signature = super().state_dict(), signature
        return self._cached


class ReusedOptimizerState(OptimizerState):
    """`OptimizerState` reused like `ReusedModelState`, with the hyperparameters (a scheduler changes the learning
    rate in place of the group's value) read again on every call."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__(model, optimizer)
        self._cached: Optional[dict[str, Any]] = None
        self._signature: tuple = ()

    def _sign(self) -> tuple:
        state = self.optimizer.state
        return (len(self.optimizer.param_groups),
                tuple((id(p), k, storage_key(v) if isinstance(v, torch.Tensor) else repr(v))
                      for p, per_param in state.items() for k, v in per_param.items()))

    def state_dict(self) -> dict[str, Any]:
        if self._cached is None or self._sign() != self._signature:
            self._cached = super().state_dict()
            self._signature = self._sign()  # after: torch's helper creates the state of a fresh optimizer
        else:
            for cached, live in zip(self._cached["param_groups"], self.optimizer.param_groups):
                cached.update({k: v for k, v in live.items() if k != "params"})
        return self._cached


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


RESERVED_KEYS = ("model", "optim", "trainer", "rng")


class TrainState:
    """What a checkpoint of a job holds: model, optimizer, any `Stateful` extras, the step and every RNG.

        state = TrainState(model=model, optim=optimizer, scheduler=scheduler, data=sampler)

    `model` and `optim` go through torch's distributed state-dict helpers (sharded FSDP2/DTensor state,
    loadable at another world size); each extra (anything with `state_dict()`/`load_state_dict()`) is saved under
    its keyword. `step` is the number of optimizer steps done; the step loop keeps it.

    `trainable_only=True`: checkpoints hold only the model's parameters that require a gradient (and their
    optimizer state, which is all an optimizer over them has): for LoRA or frozen layers, where the frozen part
    is the same on every start. Fill the frozen parameters yourself before the step loop, on every start (a resume
    loads only the trained ones over them), and put what identifies them into the loop's `fingerprint`.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, optim: Optional[torch.optim.Optimizer] = None, *,
                 trainable_only: bool = False, **extras: Any):
        if optim is not None and model is None:
            raise ConfigError("TrainState(optim=...) needs model=... too: optimizer state is saved by parameter name")
        for name, value in extras.items():
            if name in RESERVED_KEYS or "/" in name or "." in name:
                raise ConfigError(f"TrainState: {name!r} is not a usable name for an extra (reserved: "
                                f"{', '.join(RESERVED_KEYS)}; no '/' or '.'); pick another keyword")
            if not (callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))):
                raise ConfigError(f"TrainState: {name}={type(value).__name__} has no state_dict()/load_state_dict(); "
                                f"give it those two methods (torch's Stateful protocol) or leave it out")
        self.model, self.optim, self.extras = model, optim, dict(extras)
        self.trainable_only = trainable_only
        self.step = 0
        self._reused: dict[str, Stateful] = {}

    def adopt(self, other: "TrainState") -> None:
        """Take `other`'s model, optimizer and extras (a model built again on a new mesh: the in-place shrink);
        extras `other` lacks (samplers) stay. The step stays too: the load that follows sets it."""
        self.model, self.optim, self.trainable_only = other.model, other.optim, other.trainable_only
        self.extras.update(other.extras)
        self._reused = {}

    @property
    def samplers(self) -> list[ElasticSampler]:
        return [v for v in self.extras.values() if isinstance(v, ElasticSampler)]

    def _progress(self) -> dict[str, Any]:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return {"step": self.step, "world_size": world}

    def _load_progress(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])

    def checkpoint_state(self, rank: int, include_rng: bool = True, reuse: bool = False,
                         for_load: bool = False) -> dict[str, Any]:
        """The DCP state dict of this rank (Stateful values: read at save time, filled in place at load).

        `reuse`: for a save every step (snapshots): the model's and optimizer's state dicts are built once and
        reused while they hold the live tensors (`ReusedModelState`); never for a load. `for_load`: the dict is
        only loaded into (a fresh optimizer's state is allocated, not computed: `OptimizerState`).
        """
        out: dict[str, Any] = {}
        if self.model is not None:
            out["model"] = self._reused.setdefault("model", ReusedModelState(self.model, self.trainable_only)) \
                if reuse else ModelState(self.model, self.trainable_only)
        if self.optim is not None:
            assert self.model is not None
            out["optim"] = self._reused.setdefault("optim", ReusedOptimizerState(self.model, self.optim)) if reuse \
                else OptimizerState(self.model, self.optim, for_load=for_load)
        out.update(self.extras)
        out["trainer"] = CallbackState(self._progress, self._load_progress)
        if include_rng:
            out[rng_key(rank)] = CallbackState(_rng_state, _load_rng_state)
        return out

    def digest(self) -> dict[str, str]:
        """sha256 of the full (unsharded) model parameters and optimizer state; a collective: every rank calls it.

        Equal digests after two runs mean bitwise-equal training state; see `param_digest`, `optim_digest`.
        Every rank gets the same digests.
        """
        out = {}
        if self.model is not None:
            out["model"] = param_digest(self.model)
        if self.optim is not None:
            assert self.model is not None
            out["optim"] = optim_digest(self.model, self.optim)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # The full state is gathered on rank 0 only (cpu_offload): the other ranks hashed an empty dict.
            box = [out]
            dist.broadcast_object_list(box, src=0)
            out = box[0]
        return out


def _rng_state() -> dict[str, Any]:
    return {"blob": pickle.dumps(capture_rng_state())}


def _load_rng_state(state: dict[str, Any]) -> None:
    restore_rng_state(pickle.loads(state["blob"]))


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _hash_tensor(h: "hashlib._Hash", name: str, value: Any) -> None:
    h.update(name.encode())
    if isinstance(value, torch.Tensor):
        h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    else:  # a plain number (e.g. an optimizer's step kept as a float)
        h.update(repr(value).encode())


def param_digest(model: torch.nn.Module) -> str:
    """sha256 over the full (unsharded) parameters; a collective: every rank calls it, rank 0's result counts."""
    full = get_model_state_dict(model, options=_FULL)
    h = hashlib.sha256()
    for name in sorted(full):
        _hash_tensor(h, name, full[name])
    return h.hexdigest()


def optim_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over the full (unsharded) optimizer state; a collective: every rank calls it, rank 0's result counts.

    Every parameter's state (AdamW: exp_avg, exp_avg_sq, step) by FQN, then the param groups' hyperparameters
    (lr as the scheduler left it, betas, weight decay), so a resume that restores the parameters but not the
    optimizer or the LR schedule gives another digest.
    """
    full = get_optimizer_state_dict(model, optimizer, options=_FULL)
    h = hashlib.sha256()
    state = full.get("state", {})
    for fqn in sorted(state):
        for key in sorted(state[fqn]):
            _hash_tensor(h, f"{fqn}/{key}", state[fqn][key])
    h.update(json.dumps(full.get("param_groups", []), sort_keys=True).encode())
    return h.hexdigest()
