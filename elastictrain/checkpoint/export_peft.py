"""Export of LoRA and frozen-layer checkpoints, which hold only the trained tensors (model.lora, model.freeze).

- A LoRA adapter in PEFT's own format (adapter_config.json + adapter_model.safetensors), written by peft itself
  (`PeftModel.save_pretrained`) from the model's skeleton on the meta device: no base weights are read, and
  `PeftModel.from_pretrained(base, dir)` loads it.
- `merged`: the complete model as a transformers directory (config.json + model.safetensors): the base read from
  the pretrained directory it was trained on, the adapter merged into it (peft's `merge_and_unload`) or the trained
  tensors put over its frozen ones. The base is checked against the checkpoint's fingerprint of it first.

The checkpoint's metadata (written by the recipe) says what it holds: `hf_config`, `lora` (peft's LoraConfig
arguments), `base_model` (the directory the base came from) and `trainable_only`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch

from elastictrain.checkpoint.base_weights import BASE_PART, base_fingerprint
from elastictrain.checkpoint.discovery import CheckpointInfo
from elastictrain.checkpoint.export import export_hf, load_model_state
from elastictrain.checkpoint.storage import Storage
from elastictrain.errors import CheckpointError

log = logging.getLogger(__name__)

ADAPTER_NAME = "default"
"""The adapter's name in the trained model's parameter names (`lora_A.default.weight`): peft's default."""


def export_checkpoint(storage: Storage, info: CheckpointInfo, out_dir: str, *, merged: bool = False,
                      base: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> list[str]:
    """Export what the checkpoint holds: a full model as it is (`export_hf`), a LoRA adapter in PEFT's format, or
    (`merged`) the complete model over the base at `base` (default: the one the job read)."""
    extra = _extra(info)
    if not extra.get("trainable_only"):
        return export_hf(storage, info, out_dir, dtype=dtype)
    if merged:
        return export_merged(storage, info, out_dir, base=base, dtype=dtype)
    if extra.get("lora") is None:
        raise CheckpointError(f"checkpoint {info.url} holds only the trained tensors (model.freeze), not a whole "
                              f"model: pass --merged to write them over their pretrained base")
    return export_adapter(storage, info, out_dir)


def _extra(info: CheckpointInfo) -> dict[str, Any]:
    return dict(info.manifest.metadata.extra) if info.manifest is not None else {}


def _hf_config(info: CheckpointInfo, base: Optional[str]) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    data = _extra(info).get("hf_config")
    if data is None:
        raise CheckpointError(f"checkpoint {info.url} carries no hf_config (not written by the recipe); export "
                              f"it without --merged")
    cfg = AutoConfig.for_model(data["model_type"])
    cfg = type(cfg).from_dict({k: v for k, v in data.items() if k != "model_type"})
    assert isinstance(cfg, PretrainedConfig)
    cfg._name_or_path = base or ""  # becomes adapter_config.json's base_model_name_or_path
    return cfg


def _lora(info: CheckpointInfo) -> Any:
    from peft import LoraConfig

    return LoraConfig(**_extra(info)["lora"])


def _adapter_tensors(storage: Storage, info: CheckpointInfo) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().clone() for k, v in load_model_state(storage, info).items()}


def _put(model: torch.nn.Module, tensors: dict[str, torch.Tensor], url: str, assign: bool) -> None:
    """Load the trained tensors into `model` by name; every one must find its place."""
    result = model.load_state_dict(tensors, strict=False, assign=assign)
    if result.unexpected_keys:
        raise CheckpointError(f"checkpoint {url}: {len(result.unexpected_keys)} trained tensors have no place in "
                              f"the model ({', '.join(result.unexpected_keys[:5])}); is hf_config the model's?")


def export_adapter(storage: Storage, info: CheckpointInfo, out_dir: str) -> list[str]:
    """Write the LoRA adapter in PEFT's format; returns the paths written."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    extra = _extra(info)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(_hf_config(info, extra.get("base_model")), dtype=torch.float32)
    peft_model = get_peft_model(skeleton, _lora(info), adapter_name=ADAPTER_NAME)
    # The trained names are the adapted transformers model's (peft injected the same layers into it).
    _put(peft_model.base_model.model, _adapter_tensors(storage, info), info.url, assign=True)
    os.makedirs(out_dir, exist_ok=True)
    # save_embedding_layers=False: "auto" asks the Hub whether the base's vocabulary was resized.
    peft_model.save_pretrained(out_dir, safe_serialization=True, save_embedding_layers=False)
    log.info("exported the LoRA adapter of step %d from %s to %s", info.step, info.url, out_dir)
    return [os.path.join(out_dir, name) for name in ("adapter_config.json", "adapter_model.safetensors")]


def export_merged(storage: Storage, info: CheckpointInfo, out_dir: str, *, base: Optional[str] = None,
                  dtype: Optional[torch.dtype] = None) -> list[str]:
    """Write the complete model (the base with the trained tensors or the merged adapter); returns the paths."""
    from transformers import AutoModelForCausalLM

    base = _base_dir(info, base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    tensors = _adapter_tensors(storage, info)
    if _extra(info).get("lora") is not None:
        from peft import get_peft_model

        peft_model = get_peft_model(model, _lora(info), adapter_name=ADAPTER_NAME)
        _put(peft_model.base_model.model, tensors, info.url, assign=False)
        model = peft_model.merge_and_unload()
    else:
        _put(model, tensors, info.url, assign=False)
    if dtype is not None:
        model = model.to(dtype)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    log.info("exported step %d of %s merged into the base %s to %s", info.step, info.url, base, out_dir)
    return sorted(str(p) for p in Path(out_dir).iterdir() if p.suffix in (".json", ".safetensors"))


def _base_dir(info: CheckpointInfo, base: Optional[str]) -> str:
    """The pretrained directory to merge into, checked against the checkpoint's fingerprint of its base."""
    recorded = _extra(info).get("base_model")
    path = base or recorded
    if not path:
        raise CheckpointError(f"checkpoint {info.url} was trained on a randomly initialised base (model.init=random), "
                              f"which is not stored: a merged export needs a pretrained base (--base DIR)")
    if not (Path(path) / "config.json").is_file():
        raise CheckpointError(f"the base model directory {path!r} (recorded at training) has no config.json; pass "
                              f"--base DIR, the pretrained model the checkpoint was trained on")
    expected = info.manifest.metadata.fingerprint.get(BASE_PART) if info.manifest is not None else None
    found = base_fingerprint(path)
    if expected is not None and found != expected:
        raise CheckpointError(f"the base model at {path!r} is not the one checkpoint {info.url} was trained on "
                              f"(weights fingerprint {found}, checkpoint {expected}); pass --base DIR with that "
                              f"model")
    return path
