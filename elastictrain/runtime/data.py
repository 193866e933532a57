"""Training data sources. A source maps a dataset index to `seq_len + 1` token ids; nothing is downloaded.

- `SyntheticSource`: sample i is an arithmetic token sequence whose start and stride come from (seed, i):
  deterministic, infinite in practice, and learnable (the loss falls), so runs are meaningful without data.
- `TokenFileSource`: a flat binary file of token ids (uint8 for byte-level text, uint16/uint32 for tokenized
  corpora), memory-mapped; sample i is the window [i * seq_len, i * seq_len + seq_len + 1).
- `PackedSource` (runtime/packing.py) for the jsonl / parquet / hf_disk sources: rows tokenized as text or chat
  (runtime/chat.py), packed into seq_len sequences; its index i is a packed sequence, not a row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Protocol, Sequence, Union

import numpy as np
import torch

from elastictrain.config import DATASET_SOURCES, DataConfig
from elastictrain.errors import DataError
from elastictrain.runtime.chat import encode_rows, load_tokenizer
from elastictrain.runtime.packing import PackedSource, check_packed_attention, pack
from elastictrain.runtime.rows import read_rows

SAMPLE_CORPUS = Path(__file__).resolve().parent.parent / "data" / "sample_corpus.txt"


class TokenSource(Protocol):
    num_samples: int
    seq_len: int

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        """int64 tensor of shape (len(indices), seq_len + 1)."""
        ...


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a cheap, well-spread hash of uint64 values."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class SyntheticSource:
    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int):
        if vocab_size < 2:
            raise DataError(f"synthetic data needs a vocabulary of at least 2 tokens (model vocab_size={vocab_size})")
        self.num_samples, self.seq_len, self.vocab_size, self.seed = num_samples, seq_len, vocab_size, seed

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        with np.errstate(over="ignore"):
            idx = np.asarray(indices, dtype=np.uint64) ^ _mix(np.full(len(indices), self.seed, dtype=np.uint64))
            h1 = _mix(idx)
            h2 = _mix(h1)
        start = (h1 % np.uint64(self.vocab_size)).astype(np.int64)
        # a small set of strides keeps the task learnable by a tiny model in a few hundred steps
        stride = 1 + (h2 % np.uint64(min(7, self.vocab_size - 1))).astype(np.int64)
        j = np.arange(self.seq_len + 1, dtype=np.int64)
        tokens = (start[:, None] + stride[:, None] * j[None, :]) % self.vocab_size
        return torch.from_numpy(tokens)


class TokenFileSource:
    def __init__(self, path: Path, dtype: str, seq_len: int, vocab_size: int):
        if not path.is_file():
            raise DataError(f"data.path={str(path)!r} does not exist; point data.path at a local file "
                            f"(or 'sample' for the bundled corpus)")
        self.path = path
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.seq_len = seq_len
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise DataError(f"data.path={str(path)!r} holds {len(self.tokens)} tokens, fewer than one sample of "
                            f"data.seq_len={seq_len} + 1; use a larger file or a smaller seq_len")
        if np.dtype(dtype).itemsize == 1 and vocab_size < 256:
            raise DataError(f"byte-level data needs model vocab_size >= 256 (got {vocab_size}); "
                            f"set model.overrides.vocab_size=256")
        self.vocab_size = vocab_size

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        L = self.seq_len
        rows = np.stack([np.asarray(self.tokens[i * L: i * L + L + 1], dtype=np.int64) for i in indices])
        top = int(rows.max()) if rows.size else 0
        if top >= self.vocab_size:
            raise DataError(f"{self.path}: token id {top} >= model vocab_size {self.vocab_size}; check "
                            f"data.token_dtype or set model.overrides.vocab_size")
        return torch.from_numpy(rows)


def build_source(cfg: DataConfig, vocab_size: int, seed: int,
                 model_path: Optional[str] = None) -> Union[TokenSource, PackedSource]:
    """The configured source; the dataset sources take their tokenizer from data.tokenizer, else `model_path`."""
    if cfg.source in DATASET_SOURCES:
        return build_packed_source(cfg, vocab_size, seed, model_path)
    if cfg.source == "synthetic":
        return SyntheticSource(cfg.synthetic_samples, cfg.seq_len, vocab_size, seed)
    path = SAMPLE_CORPUS if cfg.path == "sample" else Path(str(cfg.path)).expanduser()
    dtype = "uint8" if cfg.source == "text" else cfg.token_dtype
    return TokenFileSource(path, dtype, cfg.seq_len, vocab_size)


def build_packed_source(cfg: DataConfig, vocab_size: int, seed: int, model_path: Optional[str]) -> PackedSource:
    field = "data.tokenizer" if cfg.tokenizer is not None else "model.path"
    tokenizer = load_tokenizer(str(cfg.tokenizer if cfg.tokenizer is not None else model_path), field)
    samples = encode_rows(read_rows(cfg), tokenizer, cfg, vocab_size)
    if cfg.packing:
        check_packed_attention()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return PackedSource(samples, pack(samples, cfg.seq_len, seed, cfg.packing), int(pad or 0))
