"""Pretrained safetensors weights into a sharded model, each rank reading only the rows of its own shards.

The reader is torch's own: `dcp.load` with `HuggingFaceStorageReader` (torch.distributed.checkpoint). For every
DTensor we hand it, DCP's planner intersects this rank's local chunk (`DTensor.__create_chunk_list__`, the dim-0
rows FSDP2 gave it, uneven or empty ones included) with the stored tensor, and the reader reads exactly that region
with safetensors' `safe_open(file).get_slice(name)[rows]` from a memory map, then `copy_`s it into the shard, which
converts the dtype (a bf16 file into fp32 parameters). No rank reads another rank's rows or builds a full tensor.

What DCP does not do the way transformers' `from_pretrained` does is done here first, from the files' headers only
(no tensor data): names that differ by the base model's prefix (`model.`), tied weights stored once, and missing
keys or shape mismatches, which are one ConfigError naming the keys and model.path instead of DCP's traceback.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader

from elastictrain.config import safetensors_files, torch_weight_files
from elastictrain.errors import ConfigError
from elastictrain.recipes.adapters import base_name, is_adapter

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_SHOWN = 5
"""How many keys an error names."""


@dataclass
class KeyMatch:
    """How the model's tensors pair with the stored ones (names and global shapes only)."""

    stored_name: dict[str, str] = field(default_factory=dict)
    """Model name -> the name in the files."""
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    """'name: file (shape) vs model (shape)' lines."""
    unexpected: list[str] = field(default_factory=list)


def match_keys(model: dict[str, tuple[int, ...]], tied: set[str], stored: dict[str, tuple[int, ...]],
               prefix: str) -> KeyMatch:
    """Pair each model tensor with a stored one, as transformers does: the same name, or the name with the base
    model's prefix added or removed (a checkpoint of the bare `LlamaModel` into `LlamaForCausalLM`, or the other
    way). `tied` are the model names that share another name's tensor; files usually store those once."""
    m = KeyMatch()
    used: set[str] = set()
    for name, shape in model.items():
        found = next((c for c in _candidates(name, prefix) if c in stored), None)
        if found is None:
            m.missing.append(name)
        elif tuple(stored[found]) != tuple(shape):
            m.mismatched.append(f"{found}: file {tuple(stored[found])} vs model {tuple(shape)}")
        else:
            m.stored_name[name] = found
        used.add(found or "")
    ignored = {c for name in tied for c in _candidates(name, prefix)}
    m.unexpected = sorted(k for k in stored if k not in used and k not in ignored)
    return m


def _candidates(name: str, prefix: str) -> list[str]:
    if not prefix:
        return [name]
    head = prefix + "."
    return [name, name[len(head):]] if name.startswith(head) else [name, head + name]


def model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The tensors a pretrained load fills (parameters once each, persistent buffers) and the names tied to an
    earlier parameter. Non-persistent buffers (rotary tables) are in no weights file and stay as built. A LoRA
    adapter's weights are not read (recipes/adapters.py fills them); the layers it wraps are, by their own names."""
    tensors: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    tied: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if is_adapter(name):
            continue
        name = base_name(name)
        if id(p) in first:
            tied.add(name)
        else:
            first[id(p)] = name
            tensors[name] = p
    for module_name, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                tensors[base_name(f"{module_name}.{name}" if module_name else name)] = b
    return tensors, tied


def stored_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Name -> global shape of every tensor in the *.safetensors files of `path`, from their headers."""
    if not safetensors_files(path):
        bins = torch_weight_files(path)
        only = f" (only {', '.join(bins[:_SHOWN])}, which are not read)" if bins else ""
        raise ConfigError(f"model.init=pretrained but model.path={path!r} has no *.safetensors weights{only}; "
                          f"point it at a directory saved with safe_serialization (model.safetensors, or "
                          f"model-0000x-of-0000y.safetensors with {INDEX_FILE}), or set model.init=random")
    _check_index(path)
    metadata = HuggingFaceStorageReader(path).read_metadata()
    shapes = {}
    for name, md in metadata.state_dict_metadata.items():
        offsets = [tuple(c.offsets) for c in md.chunks]  # type: ignore[union-attr]
        if len(set(offsets)) < len(offsets):
            raise ConfigError(f"model.path={path!r}: tensor {name!r} is stored in more than one *.safetensors file; "
                              f"remove the stale files (keep those named in {INDEX_FILE})")
        shapes[name] = tuple(md.size)  # type: ignore[union-attr]
    return shapes


def _check_index(path: str) -> None:
    index = Path(path) / INDEX_FILE
    if not index.is_file():
        return
    try:
        files = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, AttributeError) as e:
        raise ConfigError(f"model.path={path!r}: {INDEX_FILE} is not a transformers weight index ({e}); "
                          f"save the model again with save_pretrained") from None
    absent = sorted(f for f in files if not (Path(path) / f).is_file())
    if absent:
        raise ConfigError(f"model.path={path!r}: {INDEX_FILE} names {len(absent)} missing file(s) "
                          f"({', '.join(absent[:_SHOWN])}); copy the complete checkpoint there")


def load_pretrained(model: torch.nn.Module, path: str) -> None:
    """Fill a `build_sharded` model from the safetensors weights in `path`; a collective (every rank calls it)."""
    started = time.monotonic()
    tensors, tied = model_tensors(model)
    stored = stored_shapes(path)
    m = match_keys({n: tuple(t.shape) for n, t in tensors.items()}, tied, stored,
                   getattr(model, "base_model_prefix", ""))
    if m.missing or m.mismatched:
        raise ConfigError(_mismatch_message(m, path, len(tensors)))
    if m.unexpected:
        log.warning("model.path=%r: %d stored tensor(s) the model does not have, not read: %s", path,
                    len(m.unexpected), _first(m.unexpected))
    with torch.no_grad():
        dcp.load({m.stored_name[n]: t for n, t in tensors.items()}, storage_reader=HuggingFaceStorageReader(path))
    log.info("loaded %d pretrained tensors from %s in %.2fs (this rank's shards only)", len(tensors), path,
             time.monotonic() - started)


def _mismatch_message(m: KeyMatch, path: str, total: int) -> str:
    parts = []
    if m.missing:
        parts.append(f"{len(m.missing)} of the model's {total} tensors are not in the files ({_first(m.missing)})")
    if m.mismatched:
        parts.append(f"{len(m.mismatched)} have another shape there ({_first(m.mismatched)})")
    return (f"model.path={path!r} does not match the model: {'; '.join(parts)}; check that the config.json there "
            f"belongs to these weights and that model.overrides changes no size")


def _first(items: list[str]) -> str:
    more = f", ... {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more
