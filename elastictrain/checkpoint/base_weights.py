"""The identity of a pretrained model directory's weights, for checkpoints that do not hold them.

A LoRA or frozen-layer checkpoint holds only the trained parameters; the frozen base is read from `model.path` on
every start and by `ckpt export --merged`. Both must get the base the checkpoint was trained on: its fingerprint is
a part of the checkpoint's config fingerprint (`BASE_PART`), compared at resume and at a merged export.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from elastictrain.config import safetensors_files

BASE_PART = "base_weights"
"""The config fingerprint's part that holds `base_fingerprint(model.path)`."""
_SAMPLE_BYTES = 1 << 16
_SAMPLES_PER_FILE = 8


def base_fingerprint(path: str | Path) -> str:
    """A short hash of a pretrained directory's weights: config.json, each safetensors header (names, dtypes,
    shapes, offsets), file sizes and 64 KiB of tensor bytes at 8 places per file.

    It reads a few MB, not the weights: a base replaced by another of the same architecture (an instruct model for
    its base) differs everywhere, so the samples catch it; a change of a few values in place would not be seen.
    """
    h = hashlib.sha256()
    root = Path(path)
    if (root / "config.json").is_file():
        h.update((root / "config.json").read_bytes())
    for name in safetensors_files(root):
        with open(root / name, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            header_len = int.from_bytes(f.read(8), "little")
            h.update(json.dumps([name, size]).encode() + f.read(header_len))
            start = 8 + header_len
            step = max(1, (size - start) // _SAMPLES_PER_FILE)
            for offset in range(start, size, step):
                f.seek(offset)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:16]
