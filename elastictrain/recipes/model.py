"""Causal LM from a transformers config (nothing downloaded), wrapped in FSDP2 per decoder block and at the root."""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from elastictrain.checkpoint.buffers import unfilled
from elastictrain.config import ModelConfig, OptimConfig, TrainConfig
from elastictrain.errors import ConfigError
from elastictrain.recipes.adapters import apply_adapters, base_name, init_adapters, is_adapter
from elastictrain.recipes.pretrained import load_pretrained
from elastictrain.runtime.determinism import derive_seed

log = logging.getLogger(__name__)


def build_config(cfg: ModelConfig):
    from transformers import AutoConfig

    try:
        if cfg.path is not None:
            hf = AutoConfig.from_pretrained(cfg.path, local_files_only=True)
        else:
            hf = AutoConfig.for_model(cfg.name)
    except ValueError as e:
        raise ConfigError(f"model.name={cfg.name!r} is not a transformers model type ({e}); use e.g. llama, "
                          f"gpt2, qwen2, mistral, or set model.path to a local config directory") from None
    except OSError as e:
        raise ConfigError(f"model.path={cfg.path!r}: cannot read a transformers config there ({e})") from None
    for key, value in cfg.overrides.items():
        if not hasattr(hf, key) and key not in hf.attribute_map:
            raise ConfigError(f"model.overrides.{key}: {type(hf).__name__} has no attribute {key!r}; "
                              f"check the spelling against the model's config")
        setattr(hf, key, value)
    hf._attn_implementation = cfg.attn_implementation
    return hf


def build_model(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    """The same initial weights on every rank: the init RNG is seeded from (seed, 'init') only."""
    hf = build_config(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "init"))
        return _from_config(cfg, hf)


def _from_config(cfg: ModelConfig, hf) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        # fp32 parameters whatever the config's `dtype` (a bf16 checkpoint's config says bfloat16, which
        # transformers would build in): they are the optimizer's master weights; train.precision sets the compute.
        return AutoModelForCausalLM.from_config(hf, attn_implementation=cfg.attn_implementation,
                                                dtype=torch.float32)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside go to the meta device: no memory and no initialisation cost; buffers stay real
    (a rotary table is computed in `__init__` and is in no checkpoint, so a load would not restore it)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: Optional[torch.nn.Parameter]) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_sharded(cfg: ModelConfig, mesh: DeviceMesh, train: TrainConfig, device: torch.device) -> torch.nn.Module:
    """The model sharded over `mesh` with its parameters allocated but not initialised: a resume loads into it,
    a fresh start calls `fill_weights` (the step loop's `init`). `model.lora` and `model.freeze` are applied here,
    on the meta device (recipes/adapters.py).

    A restart used to build and initialise the whole model on every rank (2.6 s at 150M parameters here, and a
    full unsharded copy in each rank's memory) only for the load to overwrite it.
    """
    with _parameters_on_meta():
        model = apply_adapters(_from_config(cfg, build_config(cfg)), cfg)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model = shard_model(model, mesh, train, device)
    with unfilled():  # every parameter is loaded or initialised next: torch's deterministic fill would be a wasted pass
        model.to_empty(device=device)  # the shards' memory; buffers are emptied too, so put them back
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    return model


def fill_weights(model: torch.nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Fill a `build_sharded` model as `model.init` says (pretrained weights or random from the seed), then its LoRA
    adapter, if any; a collective (every rank calls it)."""
    if cfg.init == "pretrained":
        load_pretrained(model, str(cfg.path))
    else:
        init_weights(model, cfg, seed)
    if cfg.lora is not None:
        init_adapters(model, seed)


def init_weights(model: torch.nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Fill a `build_sharded` model with the weights `build_model(cfg, seed)` has: the same at any world size (each
    rank builds the full model on the CPU and keeps its own shards). A LoRA adapter's weights are left as they are
    (`init_adapters`); the layers it wraps get the weights they have without it."""
    full = dict(build_model(cfg, seed).named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                continue
            value = full[base_name(name)].to(param.device)
            if isinstance(param, DTensor):  # this rank's slice, cut locally (torch's set_model_state_dict: 2.7x slower)
                value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
                param = param.to_local()
            param.copy_(value)


def preload(cfg: ModelConfig) -> None:
    """Import the model's transformers classes now (seconds of lazy imports), without building it."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM._model_mapping[type(build_config(cfg))]


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks: the largest ModuleList (llama: model.layers, gpt2: transformer.h)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return []
    return list(max(lists, key=len))


def mixed_precision(precision: str, device: torch.device) -> Optional[MixedPrecisionPolicy]:
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, train: TrainConfig, device: torch.device) -> torch.nn.Module:
    """fully_shard each decoder block, then the root (embeddings, final norm, head). Parameters on the meta device
    stay there (`build_sharded` allocates the shards afterwards)."""
    if not any(p.is_meta for p in model.parameters()):
        model.to(device)
    mp = mixed_precision(train.precision, device)
    kwargs = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    for block in decoder_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, total_steps: int):
    # No weight decay on biases and norms (1-D parameters), as usual for transformers. Frozen parameters (model.lora,
    # model.freeze) get no optimizer state at all.
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)
