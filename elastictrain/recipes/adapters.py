"""LoRA adapters (peft) and frozen parameters: what `model.lora` and `model.freeze` do to the recipe's model.

The adapter is injected with peft's `inject_adapter_in_model` into the transformers model while its parameters
are still on the meta device, before `fully_shard`. Injection replaces each target `nn.Linear` in place by peft's
`lora.Linear` (the original layer kept as its `base_layer`, `lora_A`/`lora_B` beside it) and leaves the model's
class, its module tree and its forward as they were, so the rest of the build is unchanged: the decoder blocks
are sharded one by one (each adapter is sharded with its block), `to_empty` allocates every shard, the
pretrained DCP load reads the base weights by their transformers names (`.base_layer` removed) and the adapter
is initialised here. `get_peft_model` would wrap the model in a `PeftModel` (names under `base_model.model.`,
another forward and root module), which every one of those steps would have to see through.

peft marks every parameter but the adapter's as frozen (requires_grad=False); `model.freeze` freezes more by name.
A checkpoint then holds the trained parameters only (`TrainState(trainable_only=True)`) and the frozen base
comes from `model.init` on every start: `job_fingerprint` adds the base weights' identity, so that a resume onto
another base is refused.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from elastictrain.checkpoint.base_weights import BASE_PART, base_fingerprint
from elastictrain.checkpoint.export_peft import ADAPTER_NAME
from elastictrain.config import JobConfig, LoraSettings, ModelConfig
from elastictrain.errors import ConfigError
from elastictrain.runtime.determinism import derive_seed

log = logging.getLogger(__name__)

_BASE_LAYER = "base_layer."


def lora_kwargs(lora: LoraSettings) -> dict[str, Any]:
    """peft's LoraConfig arguments for these settings (default initialisation: A Kaiming-uniform, B zero); kept in
    each checkpoint's metadata for `ckpt export`."""
    return {"r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": list(lora.target_modules), "bias": "none", "task_type": "CAUSAL_LM"}


def peft_config(lora: LoraSettings) -> Any:
    from peft import LoraConfig

    return LoraConfig(**lora_kwargs(lora))


def apply_adapters(model: torch.nn.Module, cfg: ModelConfig) -> torch.nn.Module:
    """Inject `model.lora` (freezing all else) and freeze `model.freeze`'s parameters; before `fully_shard`."""
    if cfg.lora is not None:
        from peft import inject_adapter_in_model

        try:
            # low_cpu_mem_usage: the adapter's weights are made on the meta device too; `init_adapters` fills them.
            model = inject_adapter_in_model(peft_config(cfg.lora), model, ADAPTER_NAME, low_cpu_mem_usage=True)
        except ValueError as e:
            raise ConfigError(f"model.lora.target_modules={cfg.lora.target_modules}: {_first_line(e)}; name "
                              f"modules of this model ({', '.join(linear_names(model)[:8])})") from None
    for pattern in cfg.freeze:
        matched = [p for name, p in model.named_parameters() if _matches(pattern, name)]
        if not matched:
            names = [n for n, _ in model.named_parameters()]
            raise ConfigError(f"model.freeze pattern {pattern!r} matches no parameter; names look like "
                              f"{', '.join(names[:3])}, ... (globs: * ? [0-5])")
        for p in matched:
            p.requires_grad_(False)
    return model


def _matches(pattern: str, name: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(base_name(name), pattern)


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last name parts of the model's Linear layers (what target_modules can name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def base_name(name: str) -> str:
    """A parameter's name in the model without adapters (peft keeps a wrapped layer as `<layer>.base_layer`)."""
    return name.replace("." + _BASE_LAYER, ".")


def is_adapter(name: str) -> bool:
    """Does this parameter belong to a LoRA adapter (peft's `lora_A`, `lora_B`, `lora_embedding_*`)?"""
    return any(part.startswith("lora_") for part in name.split("."))


def has_frozen(model: torch.nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """Fill the adapter's weights as peft's `reset_lora_parameters` does by default (A: Kaiming-uniform with
    a=sqrt(5), B: zeros, so the adapted model starts equal to its base), from (seed, 'lora', name): the same values
    at any world size (each rank draws the full tensor and keeps its own shard)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not is_adapter(name):
                continue
            value = torch.zeros(param.shape, dtype=param.dtype)
            gen = torch.Generator().manual_seed(derive_seed(seed, "lora", name))
            if ".lora_A." in name and value.dim() == 2:
                bound = 1 / math.sqrt(value.shape[1])  # kaiming_uniform_(a=sqrt(5)) of a (r, in) weight
                value.uniform_(-bound, bound, generator=gen)
            elif ".lora_embedding_B." in name:  # an embedding's adapter: A zeros, B standard normal
                value.normal_(generator=gen)
            _copy_full(param, value)


def _copy_full(param: torch.Tensor, value: torch.Tensor) -> None:
    value = value.to(param.device)
    if isinstance(param, DTensor):
        value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param = param.to_local()
    param.copy_(value)


def adapter_metadata(cfg: ModelConfig) -> dict[str, Any]:
    """What `ckpt export` needs besides the tensors: the adapter's peft config and where the base came from."""
    out: dict[str, Any] = {}
    if cfg.lora is not None:
        out["lora"] = lora_kwargs(cfg.lora)
    if cfg.lora is not None or cfg.freeze:
        out["base_model"] = str(Path(cfg.path).resolve()) if cfg.path else None
        out["trainable_only"] = True
    return out


def job_fingerprint(cfg: JobConfig, trainable_only: bool) -> dict[str, str]:
    """The config's fingerprint, plus the base weights' identity when the checkpoint does not hold them."""
    fp = cfg.fingerprint()
    if trainable_only and cfg.model.init == "pretrained" and cfg.model.path:
        fp[BASE_PART] = base_fingerprint(cfg.model.path)
    return fp
