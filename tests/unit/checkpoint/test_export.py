import json
import os
import warnings

import pytest
import torch

from elastictrain.checkpoint.discovery import find_latest_valid
from elastictrain.checkpoint.export import export_hf, export_latest
from elastictrain.checkpoint.manager import CheckpointManager
from elastictrain.config import CheckpointConfig
from elastictrain.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def test_export_gives_a_hugging_face_checkpoint_that_loads_with_identical_weights(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    mgr = CheckpointManager(CheckpointConfig(url=str(tmp_path / "ck")), fingerprint={},
                            extra_metadata={"hf_config": model.config.to_dict()})
    opt = torch.optim.AdamW(model.parameters())
    mgr.save(3, {"model": get_model_state_dict(model), "optim": {"lr": 1.0}, "trainer": {"step": 3}},
             blocking=True)
    written = export_latest(str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert sorted(os.path.basename(p) for p in written) == ["config.json", "model.safetensors"]
    assert json.load(open(tmp_path / "hf" / "config.json"))["hidden_size"] == 32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    want = model.state_dict()
    got = back.state_dict()
    assert set(want) <= set(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    del opt


def test_export_names_the_keys_when_the_prefix_is_wrong(tmp_path):
    mgr = CheckpointManager(CheckpointConfig(url=str(tmp_path / "ck")), fingerprint={})
    mgr.save(1, {"net": {"w": torch.zeros(2)}}, blocking=True)
    info = find_latest_valid(mgr.storage)
    with pytest.raises(CheckpointError, match="top-level keys: net"):
        export_hf(mgr.storage, info, str(tmp_path / "hf"))
    assert export_hf(mgr.storage, info, str(tmp_path / "hf"), prefix="net", config={"a": 1})
