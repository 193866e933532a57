"""Does a checkpoint fit this job? Its format, config fingerprint, library versions, state-dict keys and shapes.

Checked before `dcp.load` so that a mismatch reads as one clear `CheckpointMismatchError` naming what
differs, instead of DCP's per-rank stack traces.

Per-rank keys: a top-level state key of the form `<name>/rank<r>` (e.g. `rng/rank3`) belongs to one
rank. At another world size such a key may not exist in the checkpoint (resuming 2 -> 3: there is no
`rng/rank2`); it is dropped from what is loaded and reported in `LoadedCheckpoint.missing_keys`, and the
training loop re-derives that state (RNG from (seed, step, rank)).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from elastictrain.checkpoint import manifest as manifest_mod
from elastictrain.checkpoint.manifest import library_versions
from elastictrain.errors import CheckpointMismatchError

if TYPE_CHECKING:
    from elastictrain.checkpoint.discovery import CheckpointInfo

log = logging.getLogger(__name__)

PER_RANK_KEY = re.compile(r"^[^.]+/rank\d+$")
_MAX_NAMED = 8


def is_per_rank_key(key: str) -> bool:
    return bool(PER_RANK_KEY.match(key))


def fingerprint_diffs(expected: Mapping[str, str], found: Mapping[str, str]) -> list[str]:
    """Each fingerprint part that differs, as 'part (checkpoint X, this job Y)'."""
    diffs = []
    for part in sorted(set(expected) | set(found)):
        a, b = expected.get(part), found.get(part)
        if a != b:
            diffs.append(f"{part} (checkpoint {b or 'absent'}, this job {a or 'absent'})")
    return diffs


def raise_mismatch(url: str, fp_diffs: list[str], key_problems: list[str]) -> None:
    """One CheckpointMismatchError naming the fingerprint parts and the keys that differ (if any do)."""
    if not fp_diffs and not key_problems:
        return
    parts = []
    if fp_diffs:
        parts.append(f"config fingerprint differs in {', '.join(fp_diffs)}")
    parts += key_problems
    raise CheckpointMismatchError(
        f"checkpoint {url} does not match this job: {'. '.join(parts)}. Resume with the configuration it was "
        f"written with, point checkpoint.resume at another checkpoint, or set checkpoint.resume=never to "
        f"start fresh")


def check_format(info: "CheckpointInfo") -> None:
    """Refuse a checkpoint written in a newer layout than this elastictrain reads (CheckpointMismatchError): loading
    it could misread it, and skipping it for an older one would silently throw the newer steps away."""
    manifest = info.manifest
    if manifest is None or manifest.format <= manifest_mod.FORMAT_VERSION:
        return
    written = manifest.metadata.versions.get("elastictrain", "a newer version")
    raise CheckpointMismatchError(
        f"checkpoint {info.url} is in checkpoint format {manifest.format} (written by elastictrain {written}); this "
        f"elastictrain ({library_versions().get('elastictrain', 'unknown')}) reads format "
        f"{manifest_mod.FORMAT_VERSION}: upgrade elastictrain on every node, or point checkpoint.resume at an older "
        f"checkpoint")


def warn_versions(current: Mapping[str, str], saved: Mapping[str, str], url: str) -> list[str]:
    """Log (warning) each library whose version differs from the checkpoint's; returns the differences."""
    diffs = [f"{k} {saved[k]} -> {current[k]}" for k in sorted(set(current) & set(saved)) if current[k] != saved[k]]
    if diffs:
        log.warning("checkpoint %s was written with other library versions (%s); loading anyway", url,
                    ", ".join(diffs))
    return diffs


def _materialize(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}


def key_problems(state: Mapping[str, Any], metadata: Metadata) -> tuple[list[str], list[str]]:
    """Compare the template's keys and tensor shapes with a checkpoint's DCP metadata.

    Returns (per-rank top-level keys absent from the checkpoint, to be skipped; problems, each naming
    keys that are missing or differ in shape).
    """
    absent_per_rank = [k for k in state if is_per_rank_key(k)
                       and not any(fqn == k or fqn.startswith(k + ".") for fqn in metadata.state_dict_metadata)]
    rest = {k: v for k, v in state.items() if k not in absent_per_rank}
    flat, _ = flatten_state_dict(_materialize(rest))
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in flat if k not in saved)
    shapes = []
    for k, v in flat.items():
        md = saved.get(k)
        if isinstance(v, torch.Tensor) and isinstance(md, TensorStorageMetadata) and tuple(v.shape) != tuple(md.size):
            shapes.append(f"{k}: checkpoint {tuple(md.size)}, model {tuple(v.shape)}")
    problems = []
    if missing:
        more = f" and {len(missing) - _MAX_NAMED} more" if len(missing) > _MAX_NAMED else ""
        problems.append(f"{len(missing)} keys of this job are not in the checkpoint: "
                        f"{', '.join(missing[:_MAX_NAMED])}{more}")
    if shapes:
        more = f" and {len(shapes) - _MAX_NAMED} more" if len(shapes) > _MAX_NAMED else ""
        problems.append(f"{len(shapes)} tensors differ in shape: {'; '.join(shapes[:_MAX_NAMED])}{more}")
    return absent_per_rank, problems
