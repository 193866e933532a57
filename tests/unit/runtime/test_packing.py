"""Packing: deterministic, every sample once per epoch, within seq_len, position ids restart, no attention leak."""

import numpy as np
import pytest
import torch

from elastictrain.config import DataConfig
from elastictrain.errors import CheckpointMismatchError
from elastictrain.runtime.chat import IGNORE, Encoded
from elastictrain.runtime.data import build_source
from elastictrain.runtime.packing import PackedSampler, PackedSource, pack
from tests.fixtures.sft import VOCAB, chat_rows, make_tokenizer, write_jsonl

SEQ = 32


def samples(n: int, seed: int = 0) -> list[Encoded]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(5, 90, size=int(rng.integers(1, 20)))
        labels = ids.copy()
        labels[: len(ids) // 2] = IGNORE
        labels[0] = IGNORE
        out.append(Encoded(ids, labels))
    return out + [Encoded(np.arange(1, 2 * SEQ), np.arange(1, 2 * SEQ))]  # longer than seq_len: truncated


def test_packing_is_deterministic_and_holds_every_sample_once_within_seq_len():
    data = samples(200)
    a, b = pack(data, SEQ, seed=3), pack(data, SEQ, seed=3)
    assert a.digest == b.digest and np.array_equal(a.sample_ids, b.sample_ids)
    assert pack(data, SEQ, seed=4).digest != a.digest
    assert sorted(a.sample_ids.tolist()) == list(range(len(data)))
    assert len(a) < len(data) / 2, "several samples share a sequence"
    for p in range(len(a)):
        assert sum(n for _, n in a.entries(p)) <= SEQ
    taken = {s: n for p in range(len(a)) for s, n in a.entries(p)}
    assert taken[200] == SEQ, "a sample longer than seq_len keeps its first seq_len tokens"


def test_without_packing_each_sequence_is_one_sample():
    idx = pack(samples(10), SEQ, seed=0, packing=False)
    assert [idx.samples_of(p) for p in range(len(idx))] == [[i] for i in range(11)]


def test_a_packed_batch_restarts_positions_per_sample_and_masks_the_padding():
    data = samples(50)
    src = PackedSource(data, pack(data, SEQ, seed=1), pad_id=0)
    b = src.batch(list(range(len(src.packs))))
    assert b.input_ids.shape == (len(src.packs), SEQ)
    for row in range(len(src.packs)):
        at = 0
        for s, n in src.packs.entries(row):
            assert b.position_ids[row, at:at + n].tolist() == list(range(n))
            assert b.input_ids[row, at:at + n].tolist() == data[s].input_ids[:n].tolist()
            assert b.labels[row, at:at + n].tolist() == data[s].labels[:n].tolist()
            at += n
        assert (b.labels[row, at:] == IGNORE).all() and (b.input_ids[row, at:] == 0).all()
        assert b.position_ids[row, at:].tolist() == list(range(SEQ - at))
    assert src.targets(range(len(src.packs))) == int((b.labels != IGNORE).sum())


def test_samples_in_a_packed_sequence_do_not_attend_to_each_other():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64), attn_implementation="sdpa").eval()
    data = samples(40)
    src = PackedSource(data, pack(data, SEQ, seed=0), pad_id=0)
    p = max(range(len(src.packs)), key=lambda q: len(src.packs.entries(q)))
    b = src.batch([p])
    with torch.no_grad():
        packed = model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False).logits[0]
        at = 0
        for s, n in src.packs.entries(p):
            alone = model(input_ids=torch.as_tensor(data[s].input_ids[:n])[None], use_cache=False).logits[0]
            torch.testing.assert_close(packed[at:at + n], alone, atol=1e-5, rtol=1e-5)
            at += n


def test_the_sampler_consumes_every_sample_once_per_epoch_at_any_world_size():
    data = samples(300)
    idx = pack(data, SEQ, seed=0)
    epoch = len(idx)
    seen: dict[int, list[int]] = {}
    for world in (1, 2, 3):
        sampler = PackedSampler(idx, global_batch_size=4, micro_batch_size=2, seed=7)
        got = []
        while sampler.samples_consumed + 4 <= epoch:
            got += [s for r in range(world) for s in (sampler.micro_batches(r, world), sampler.last_planned)[1]]
            sampler.advance()
        seen[world] = sorted(got)
    assert seen[1] == seen[2] == seen[3]
    assert len(set(seen[1])) == len(seen[1]), "no sample twice"
    assert len(seen[1]) > 0.9 * len(data)


def test_a_resume_over_other_packed_data_is_refused():
    data = samples(100)
    a = PackedSampler(pack(data, SEQ, seed=0), global_batch_size=4, micro_batch_size=2)
    a.advance()
    same = PackedSampler(pack(data, SEQ, seed=0), global_batch_size=4, micro_batch_size=2)
    same.load_state_dict(a.state_dict())
    assert same.samples_consumed == 4
    # the same lengths (so the same number of sequences) with other tokens: only the digest tells them apart
    other = [Encoded(s.input_ids + 1, s.labels) for s in data]
    with pytest.raises(CheckpointMismatchError, match="packed data differs"):
        PackedSampler(pack(other, SEQ, seed=0), global_batch_size=4, micro_batch_size=2).load_state_dict(
            a.state_dict())


def test_build_source_packs_a_chat_dataset_with_its_tokenizer(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(30))
    src = build_source(DataConfig(source="jsonl", path=str(path), seq_len=128), VOCAB, seed=0, model_path=str(tok))
    assert isinstance(src, PackedSource)
    assert sorted(src.packs.sample_ids.tolist()) == list(range(30)) and len(src.packs) < 30
    b = src.batch([0])
    assert int(b.input_ids.max()) < VOCAB and (b.labels != IGNORE).any()
