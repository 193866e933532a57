"""Export: a consolidated Hugging Face checkpoint (model.safetensors + config.json) from a sharded DCP one.

Offline and single-process (no process group): DCP's metadata says what was saved, and only the keys
under the model prefix are read. The training state stores the model under the top-level key `model`,
as `torch.distributed.checkpoint.state_dict.get_model_state_dict` returns it (transformers FQNs such
as `model.layers.0.self_attn.q_proj.weight`); the optimizer under `optim`, plus `scheduler`,
`trainer` and `rng/rank{r}`, none of which are exported. `config.json` comes from the `config`
argument or, by default, from the checkpoint's metadata (`extra["hf_config"]`, written by the recipe).

Memory: the whole model is materialised once in host memory (not the optimizer).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from elastictrain.checkpoint.discovery import CheckpointInfo, find_latest_valid
from elastictrain.checkpoint.reader import BlobReader
from elastictrain.checkpoint.storage import Storage, open_storage
from elastictrain.errors import CheckpointError

log = logging.getLogger(__name__)


def load_model_state(storage: Storage, info: CheckpointInfo, prefix: str = "model") -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors saved under top-level key `prefix`, keyed by their FQN below it."""
    reader = BlobReader(info.url, **storage.options)
    md = reader.read_metadata()
    keys = {k for k in md.state_dict_metadata if k.startswith(prefix + ".")}
    if not keys:
        tops = sorted({k.split(".", 1)[0] for k in md.state_dict_metadata})
        raise CheckpointError(f"checkpoint {info.url} has no tensors under {prefix!r} (top-level keys: "
                              f"{', '.join(tops)}); pass the key the model was saved under")
    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    model = sd.get(prefix)
    if not isinstance(model, dict):
        raise CheckpointError(f"checkpoint {info.url}: {prefix!r} is not a state dict")
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def export_hf(storage: Storage, info: CheckpointInfo, out_dir: str, *, prefix: str = "model",
              config: Optional[dict[str, Any]] = None, dtype: Optional[torch.dtype] = None) -> list[str]:
    """Write `out_dir/model.safetensors` (+ `config.json` when a config is known); returns the paths written."""
    from safetensors.torch import save_file

    tensors = load_model_state(storage, info, prefix)
    out = {}
    for k, v in tensors.items():
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        # safetensors refuses views and shared storage; every tensor gets its own contiguous copy.
        out[k] = v.detach().contiguous().clone()
    os.makedirs(out_dir, exist_ok=True)
    written = []
    path = os.path.join(out_dir, "model.safetensors")
    save_file(out, path, metadata={"format": "pt", "step": str(info.step), "source": info.url})
    written.append(path)
    cfg = config if config is not None else (info.manifest.metadata.extra.get("hf_config") if info.manifest else None)
    if cfg is not None:
        cpath = os.path.join(out_dir, "config.json")
        with open(cpath, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True, default=str)
        written.append(cpath)
    else:
        log.warning("checkpoint %s carries no hf_config and none was given: wrote weights without config.json",
                    info.url)
    log.info("exported %d tensors of step %d from %s to %s", len(out), info.step, info.url, out_dir)
    return written


def export_latest(url: str, out_dir: str, *, storage_options: Optional[dict[str, Any]] = None,
                  prefix: str = "model", config: Optional[dict[str, Any]] = None, verify: bool = True,
                  dtype: Optional[torch.dtype] = None) -> list[str]:
    """Export the newest valid checkpoint under a root URL (checksums verified first unless verify=False)."""
    storage = open_storage(url, storage_options)
    info = find_latest_valid(storage, verify=verify)
    if info is None:
        raise CheckpointError(f"no valid checkpoint under {storage.url} to export")
    return export_hf(storage, info, out_dir, prefix=prefix, config=config, dtype=dtype)
