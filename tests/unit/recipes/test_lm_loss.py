"""The recipe's loss on packed sequences: each sample's response loss as if it were alone."""

import numpy as np
import torch
import torch.nn.functional as F

from elastictrain.recipes.lm import token_loss
from elastictrain.runtime.chat import IGNORE, Encoded
from elastictrain.runtime.packing import PackedSource, pack


def test_the_packed_loss_is_the_sum_of_each_samples_loss_alone():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64), attn_implementation="sdpa").eval()
    rng = np.random.default_rng(0)
    data = []
    for _ in range(30):
        ids = rng.integers(3, 100, size=int(rng.integers(4, 16)))
        labels = ids.copy()
        labels[: int(rng.integers(1, len(ids)))] = IGNORE  # a prompt of random length
        data.append(Encoded(ids, labels))
    src = PackedSource(data, pack(data, 32, seed=0), pad_id=0)
    seqs = list(range(len(src.packs)))
    assert max(len(src.packs.entries(p)) for p in seqs) >= 3
    alone = 0.0
    with torch.no_grad():
        for s in src.packs.sample_ids.tolist():
            ids, labels = torch.as_tensor(data[s].input_ids), torch.as_tensor(data[s].labels)
            logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
            alone += float(F.cross_entropy(logits, labels[1:], ignore_index=IGNORE, reduction="sum"))
        packed = float(token_loss(model, src, seqs, torch.device("cpu")))
    assert abs(packed - alone) < 1e-4 * alone
    assert src.targets(seqs) == sum(int((d.labels != IGNORE).sum()) for d in data)
