"""model.init and the pairing of the model's tensors with a checkpoint's (names and shapes; no tensor data).

Loading itself, on real ranks, is tests/integration/test_pretrained.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.config import load_config
from elastictrain.errors import ConfigError
from elastictrain.recipes.pretrained import match_keys

MODEL = {"model.embed_tokens.weight": (101, 36), "model.layers.0.mlp.up_proj.weight": (64, 36),
         "model.norm.weight": (36,)}
TIED = {"lm_head.weight"}


def _dir(tmp_path: Path, *files: str) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    for f in files:
        (d / f).write_bytes(b"")
    return d


def test_init_defaults_to_pretrained_exactly_when_the_path_holds_safetensors(tmp_path):
    assert load_config(None, []).model.init == "random"
    config_only = _dir(tmp_path)
    assert load_config(None, [f"model.path={config_only}"]).model.init == "random"
    (config_only / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert load_config(None, [f"model.path={config_only}"]).model.init == "pretrained"
    assert load_config(None, [f"model.path={config_only}", "model.init=random"]).model.init == "random"


def test_a_path_gets_no_tiny_default_sizes(tmp_path):
    """The tiny Llama overrides are for `name: llama`; on a pretrained config they would change every shape."""
    assert load_config(None, [f"model.path={_dir(tmp_path)}"]).model.overrides == {}
    assert load_config(None, []).model.overrides["hidden_size"] == 64


def test_bin_weights_only_are_refused_rather_than_silently_trained_from_random(tmp_path):
    d = _dir(tmp_path, "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"\.bin weights but no \*\.safetensors.*model\.init=random"):
        load_config(None, [f"model.path={d}"])
    assert load_config(None, [f"model.path={d}", "model.init=random"]).model.init == "random"


def test_pretrained_without_a_path_is_one_line():
    with pytest.raises(ConfigError, match="model.init=pretrained needs model.path") as e:
        load_config(None, ["model.init=pretrained"])
    assert "\n" not in str(e.value)


def test_an_explicit_pretrained_is_accepted_while_the_weights_are_away_so_a_resume_can_go_on(tmp_path):
    """Only a fresh start reads them (and fails there, naming model.path)."""
    assert load_config(None, [f"model.path={_dir(tmp_path)}", "model.init=pretrained"]).model.init == "pretrained"


def test_the_init_choice_is_not_part_of_the_checkpoint_fingerprint(tmp_path):
    d = _dir(tmp_path)
    a = load_config(None, [f"model.path={d}", "model.init=pretrained"]).fingerprint()
    assert a == load_config(None, [f"model.path={d}", "model.init=random"]).fingerprint()


def test_names_pair_across_the_base_model_prefix_and_tied_copies_are_not_unexpected():
    bare = {"embed_tokens.weight": (101, 36), "layers.0.mlp.up_proj.weight": (64, 36), "norm.weight": (36,),
            "lm_head.weight": (101, 36)}
    m = match_keys(MODEL, TIED, bare, "model")
    assert m.stored_name["model.norm.weight"] == "norm.weight" and not (m.missing or m.mismatched or m.unexpected)
    same = {**MODEL, "model.rotary_emb.inv_freq": (18,)}
    m = match_keys(MODEL, TIED, same, "model")
    assert m.stored_name == {k: k for k in MODEL} and m.unexpected == ["model.rotary_emb.inv_freq"]


def test_missing_and_misshaped_tensors_are_named():
    stored = {"model.embed_tokens.weight": (100, 36), "model.norm.weight": (36,)}
    m = match_keys(MODEL, TIED, stored, "model")
    assert m.missing == ["model.layers.0.mlp.up_proj.weight"]
    assert m.mismatched == ["model.embed_tokens.weight: file (100, 36) vs model (101, 36)"]
