"""`model.lora` and `model.freeze` in the job config: defaults, one-line errors naming the field and the fix, and
the fingerprint parts that let a refused resume name the adapter settings."""

from __future__ import annotations

import pytest

from elastictrain.config import load_config
from elastictrain.errors import ConfigError


def test_lora_is_off_by_default_and_set_field_by_field():
    assert load_config(None, []).model.lora is None and load_config(None, []).model.freeze == []
    lora = load_config(None, ["model.lora.r=16", "model.lora.target_modules=[q_proj,k_proj,v_proj]"]).model.lora
    assert (lora.r, lora.alpha, lora.dropout, lora.target_modules) == (16, 16.0, 0.0, ["q_proj", "k_proj", "v_proj"])


@pytest.mark.parametrize("overrides,message", [
    (["model.lora.r=0"], "model.lora.r must be >= 1 (got 0)"),
    (["model.lora.alpha=-1"], "model.lora.alpha must be > 0 (got -1.0)"),
    (["model.lora.dropout=1"], "model.lora.dropout must be in [0, 1) (got 1.0)"),
    (["model.lora.target_modules=[]"], "model.lora.target_modules must list module names (got [])"),
    (["model.lora.rank=8"], "model.lora.rank: unknown field; known fields: alpha, dropout, r, target_modules"),
    (["model.lora=8"], "model.lora: expected a mapping of fields of LoraSettings, got 8"),
    (["model.freeze=['model.embed_tokens.*', ' ']"], "model.freeze[1] is empty"),
])
def test_bad_adapter_settings_are_one_line_errors_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert message in str(caught.value) and "\n" not in str(caught.value), caught.value


def test_the_fingerprint_names_the_adapter_and_the_frozen_patterns_and_is_unchanged_without_them():
    plain = load_config(None, []).fingerprint()
    assert set(plain) == {"model", "data", "seed"}
    fp = load_config(None, ["model.lora.r=4", "model.lora.alpha=8", "model.freeze=[model.norm.*]"]).fingerprint()
    assert fp["adapter"] == "lora r=4 alpha=8 dropout=0 targets=q_proj,v_proj"
    assert fp["freeze"] == "model.norm.*" and fp["model"] == plain["model"], "old checkpoints still match"
