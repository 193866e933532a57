"""Samples of different lengths packed into `seq_len` sequences, and the exactly-once cursor over them.

Packing is done once at start, in memory, from (the encoded samples, seq_len, seed) only: the samples in a seeded
shuffled order are laid greedily one after another into sequences, a sequence closed when the next sample does not
fit (next-fit). The result, a `PackIndex` (each sequence a list of (sample id, tokens taken)), is the same on
every rank at any world size, so the `ElasticSampler` runs over packed sequences with its own proven resume logic:
its cursor counts sequences, a sequence is several sample ids in the sample ledger, and a checkpoint refuses to
resume over another packing (`PackedSampler`). A sample longer than seq_len is truncated to its first seq_len
tokens (counted in a log line).

Within a sequence, position ids restart at 0 with every sample; transformers models whose masks come from
`masking_utils` (Llama, Qwen2, Mistral, ... from transformers 4.54 on) then attend only within a sample (a
block-diagonal causal mask for sdpa/eager/flex, varlen for flash-attention) when called without an attention
mask and without a cache. The unused tail of a sequence is padding: its own segment, labels IGNORE.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import numpy as np
import torch

from elastictrain.errors import CheckpointMismatchError
from elastictrain.runtime.chat import IGNORE, Encoded
from elastictrain.runtime.determinism import derive_seed
from elastictrain.runtime.sampler import ElasticSampler, MicroBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackIndex:
    """Sequence p holds the samples `sample_ids[offsets[p]:offsets[p + 1]]`, the first `lengths[...]` tokens each."""

    seq_len: int
    offsets: np.ndarray
    sample_ids: np.ndarray
    lengths: np.ndarray
    targets: np.ndarray
    """Per sequence: the tokens the loss counts (labels not IGNORE)."""
    digest: str
    """sha256 of the packing and of every sample's tokens and labels: another dataset, tokenizer, format or
    seq_len gives another digest."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def entries(self, p: int) -> list[tuple[int, int]]:
        a, b = int(self.offsets[p]), int(self.offsets[p + 1])
        return [(int(s), int(n)) for s, n in zip(self.sample_ids[a:b], self.lengths[a:b])]

    def samples_of(self, p: int) -> list[int]:
        return [int(s) for s in self.sample_ids[int(self.offsets[p]):int(self.offsets[p + 1])]]


def pack(samples: Sequence[Encoded], seq_len: int, seed: int, packing: bool = True) -> PackIndex:
    """Lay the samples into sequences (several per sequence with `packing`, else one each)."""
    order = np.random.Generator(np.random.PCG64(derive_seed(seed, "packing"))).permutation(len(samples)) \
        if packing else np.arange(len(samples))
    lengths = np.asarray([min(len(samples[s].input_ids), seq_len) for s in order], dtype=np.int64)
    targets = np.asarray([int((samples[s].labels[:n] != IGNORE).sum()) for s, n in zip(order, lengths)],
                         dtype=np.int64)
    offsets, fill = [0], 0
    for i, n in enumerate(lengths):
        if i and (not packing or fill + n > seq_len):
            offsets.append(i)
            fill = 0
        fill += int(n)
    offsets.append(len(order))
    _log_truncated(samples, seq_len)
    bounds = np.asarray(offsets, dtype=np.int64)
    idx = PackIndex(seq_len, bounds, order.astype(np.int64), lengths, np.add.reduceat(targets, bounds[:-1]), "")
    log.info("%d samples packed into %d sequences of %d tokens (%.1f%% of the tokens are padding)", len(samples),
             len(idx), seq_len, 100.0 * (1 - lengths.sum() / max(1, len(idx) * seq_len)))
    return replace(idx, digest=_digest(idx, samples))


def _log_truncated(samples: Sequence[Encoded], seq_len: int) -> None:
    long = [s for s in samples if len(s.input_ids) > seq_len]
    if long:
        lost = sum(not (s.labels[:seq_len] != IGNORE).any() for s in long)
        log.warning("%d of %d samples are longer than data.seq_len=%d and were truncated to it (%d of them kept no "
                    "token to learn from)", len(long), len(samples), seq_len, lost)


def check_packed_attention() -> None:
    """Warn when the installed transformers cannot keep packed samples apart (it predates masking_utils)."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        log.warning("this transformers version does not derive per-sample attention masks from position ids: "
                    "packed samples attend to each other; upgrade transformers (>= 4.54) or set data.packing=false")


def _digest(idx: PackIndex, samples: Sequence[Encoded]) -> str:
    h = hashlib.sha256(np.asarray([idx.seq_len], dtype=np.int64).tobytes())
    for a in (idx.offsets, idx.sample_ids, idx.lengths):
        h.update(a.tobytes())
    for s in samples:
        h.update(np.asarray([len(s.input_ids)], dtype=np.int64).tobytes())
        h.update(s.input_ids.tobytes())
        h.update(s.labels.tobytes())
    return h.hexdigest()


@dataclass
class PackedBatch:
    """Model inputs of packed sequences, each (batch, seq_len)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor

    def to(self, device: torch.device) -> "PackedBatch":
        return PackedBatch(*(t.to(device, non_blocking=True) for t in (self.input_ids, self.labels,
                                                                        self.position_ids)))


class PackedSource:
    """Packed sequences of encoded samples: `batch(indices)` builds the inputs of those sequences."""

    def __init__(self, samples: Sequence[Encoded], packs: PackIndex, pad_id: int):
        self.samples, self.packs, self.pad_id = samples, packs, pad_id
        self.num_samples, self.seq_len = len(packs), packs.seq_len

    def batch(self, indices: Sequence[int]) -> PackedBatch:
        L = self.seq_len
        ids = np.full((len(indices), L), self.pad_id, dtype=np.int64)
        labels = np.full((len(indices), L), IGNORE, dtype=np.int64)
        pos = np.zeros((len(indices), L), dtype=np.int64)
        for row, p in enumerate(indices):
            at = 0
            for s, n in self.packs.entries(p):
                ids[row, at:at + n] = self.samples[s].input_ids[:n]
                labels[row, at:at + n] = self.samples[s].labels[:n]
                pos[row, at:at + n] = np.arange(n)
                at += n
            pos[row, at:] = np.arange(L - at)  # the padding is a segment of its own
        return PackedBatch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(pos))

    def targets(self, indices: Sequence[int]) -> int:
        """Tokens the loss counts in these sequences."""
        return int(sum(int(self.packs.targets[p]) for p in indices))


class PackedSampler(ElasticSampler):
    """`ElasticSampler` over packed sequences; the sample ledger records the sample ids inside them."""

    def __init__(self, packs: PackIndex, *, global_batch_size: int, micro_batch_size: int, seed: int = 0):
        super().__init__(len(packs), global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                         seed=seed)
        self.packs = packs

    def micro_batches(self, rank: Optional[int] = None, world_size: Optional[int] = None) -> list[MicroBatch]:
        out = super().micro_batches(rank, world_size)
        self.last_planned = [s for p in self.last_planned for s in self.packs.samples_of(p)]
        return out

    def step_sequences(self) -> list[int]:
        """The whole global batch of the current step (every rank's sequences), e.g. to count its loss tokens."""
        start = self.samples_consumed
        return self.order.lookup(range(start, start + self.global_batch_size))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "packing": self.packs.digest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "packing" in state and state["packing"] != self.packs.digest:
            raise CheckpointMismatchError("the checkpoint's packed data differs from this run's (another dataset, "
                                          "tokenizer, data.format, data.seq_len or data.packing); resume with the "
                                          "same data, or use a new checkpoint URL")
        super().load_state_dict(state)
