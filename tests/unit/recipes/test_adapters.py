"""LoRA and frozen parameters in the recipe's model (recipes/adapters.py), in one real process (gloo, world 1):
what is trained, what a checkpoint holds (the trained parameters and their optimizer state only), a resume onto
the base, a refused resume of another adapter or base, and an in-memory snapshot's restore.

The 2-rank run of the recipe (resume bitwise, export, checkpoint size) is tests/integration/test_lora.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import elastictrain as et
from elastictrain.checkpoint.base_weights import base_fingerprint
from elastictrain.checkpoint.snapshot import SnapshotStore
from elastictrain.config import JobConfig, LoraSettings, ModelConfig, TrainConfig, validate_model
from elastictrain.errors import CheckpointMismatchError, ConfigError
from elastictrain.recipes.adapters import adapter_metadata, job_fingerprint
from elastictrain.recipes.model import build_optimizer, build_sharded, fill_weights
from elastictrain.runtime.train_state import param_digest

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
ADAPTED = {f"model.layers.{i}.self_attn.{m}.lora_{ab}.default.weight"
           for i in range(2) for m in ("q_proj", "v_proj") for ab in "AB"}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """Two tiny pretrained Llamas of the same architecture (other weights), the head tied to the embeddings."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SIZES, tie_word_embeddings=True))
        out[name] = tmp_path_factory.mktemp("base") / name
        model.save_pretrained(out[name], safe_serialization=True)
    return out


def _job(path: Path, lora: Optional[LoraSettings] = None, freeze: tuple[str, ...] = (), *,
         adapter: bool = True) -> JobConfig:
    """A job on the base at `path`: by default with a rank-4 LoRA on q_proj and v_proj (adapter=False: none)."""
    if lora is None and adapter:
        lora = LoraSettings(r=4)
    cfg = JobConfig(model=ModelConfig(path=str(path), overrides={}, lora=lora, freeze=list(freeze)),
                    train=TrainConfig(precision="fp32", seed=3))
    validate_model(cfg.model)
    return cfg


def _setup(w: Any, cfg: JobConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer, et.TrainState]:
    model = build_sharded(cfg.model, w.mesh, cfg.train, w.device)
    fill_weights(model, cfg.model, cfg.train.seed)
    optim, _ = build_optimizer(model, cfg.optim, 10)
    return model, optim, et.TrainState(model=model, optim=optim, trainable_only=True)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    model(input_ids=torch.randint(0, SIZES["vocab_size"], (2, 8), generator=gen)).logits.float().square().mean() \
        .backward()
    optim.step()
    optim.zero_grad()


def _run(cfg: JobConfig, ckpt: Path, steps: int, trained: Optional[list[str]] = None) -> str:
    """Train `steps` steps (resuming from `ckpt` if it holds a checkpoint), save; the full parameters' digest."""
    with et.Worker(seed=0) as w:
        model, optim, state = _setup(w, cfg)
        if trained is not None:
            trained += [n for n, p in model.named_parameters() if p.requires_grad]
        for step in w.steps(steps, state, checkpoint=str(ckpt), every_steps=steps, async_save=False,
                            fingerprint=job_fingerprint(cfg, trainable_only=True),
                            metadata={"hf_config": model.config.to_dict(), **adapter_metadata(cfg.model)}):
            _train(model, optim, step)
        return param_digest(model)


def _refusal(cfg: JobConfig, ckpt: Path) -> str:
    """The error of a resume from `ckpt` under `cfg` (caught inside the Worker, which turns it into an exit)."""
    with et.Worker(seed=0) as w:
        _, _, state = _setup(w, cfg)
        with pytest.raises(CheckpointMismatchError) as caught:
            for _ in w.steps(2, state, checkpoint=str(ckpt), fingerprint=job_fingerprint(cfg, trainable_only=True)):
                pass
    return str(caught.value)


def _saved_keys(ckpt: Path) -> set[str]:
    step = sorted(p for p in ckpt.iterdir() if p.name.startswith("step-"))[-1]
    return set(FileSystemReader(str(step)).read_metadata().state_dict_metadata)


def test_lora_trains_and_saves_only_the_adapter_and_its_optimizer_state(bases, tmp_path):
    trained: list[str] = []
    _run(_job(bases["a"]), tmp_path / "ck", 2, trained)
    assert set(trained) == ADAPTED
    keys = _saved_keys(tmp_path / "ck")
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert model_keys == ADAPTED, "the base (the tied lm_head included) is not in the checkpoint"
    optim_params = {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in keys if k.startswith("optim.state.")}
    assert optim_params == ADAPTED


def test_frozen_patterns_leave_their_parameters_out_of_training_and_checkpoints(bases, tmp_path):
    cfg = _job(bases["a"], adapter=False, freeze=("model.embed_tokens.*", "model.layers.0.*"))
    trained: list[str] = []
    _run(cfg, tmp_path / "ck", 1, trained)
    assert trained and not any(n.startswith(("model.embed_tokens.", "model.layers.0.", "lm_head.")) for n in trained)
    assert "model.layers.1.mlp.up_proj.weight" in trained
    saved = {k.removeprefix("model.") for k in _saved_keys(tmp_path / "ck") if k.startswith("model.")}
    assert saved == set(trained)


def test_a_resume_puts_the_adapter_back_onto_the_base_bitwise(bases, tmp_path):
    cfg = _job(bases["a"])
    straight = _run(cfg, tmp_path / "straight", 4)
    _run(cfg, tmp_path / "split", 2)
    assert _run(cfg, tmp_path / "split", 4) == straight


@pytest.mark.parametrize("change,named", [
    ({"lora": LoraSettings(r=8)}, ["adapter (checkpoint lora r=4 alpha=16 dropout=0 targets=q_proj,v_proj, this job "
                                   "lora r=8 alpha=16", "differ in shape",
                                   "model.model.layers.0.self_attn.q_proj.lora_A.default.weight: checkpoint (4, 32), "
                                   "model (8, 32)"]),
    ({"lora": LoraSettings(r=4, target_modules=["q_proj", "k_proj"])},
     ["targets=q_proj,v_proj, this job lora r=4 alpha=16 dropout=0 targets=q_proj,k_proj",
      "not in the checkpoint: model.model.layers.0.self_attn.k_proj.lora_A.default.weight"]),
    ({"path": "b"}, ["base_weights (checkpoint"]),
])
def test_a_checkpoint_of_another_adapter_or_base_is_refused_in_one_line_naming_it(bases, tmp_path, change, named):
    _run(_job(bases["a"]), tmp_path / "ck", 1)
    lora = change.get("lora", LoraSettings(r=4))
    cfg = _job(bases[change.get("path", "a")], lora=lora)
    message = _refusal(cfg, tmp_path / "ck")
    assert "\n" not in message and all(n in message for n in named), message


def test_the_base_fingerprint_differs_for_another_base_of_the_same_shapes(bases):
    assert base_fingerprint(str(bases["a"])) == base_fingerprint(str(bases["a"]))
    assert base_fingerprint(str(bases["a"])) != base_fingerprint(str(bases["b"]))


def test_a_snapshot_restore_with_frozen_parameters_gives_back_the_adapter_and_its_optimizer(bases, tmp_path):
    cfg = _job(bases["a"])
    job = {"run": "r1", "fingerprint": job_fingerprint(cfg, True), "world_size": 1, "url": "file:///ck"}
    with et.Worker(seed=0) as w:
        model, optim, state = _setup(w, cfg)
        for step in range(2):
            _train(model, optim, step)
        state.step = 2
        store = SnapshotStore(tmp_path, 0, job)
        store.save(state.step, state.checkpoint_state(0, reuse=True))
        expected = (param_digest(model), _optim_values(optim))

        fresh, fresh_optim, fresh_state = _setup(w, cfg)  # the base filled, the adapter as initialised
        assert param_digest(fresh) != expected[0]
        available, why = store.available()
        store.restore(available[0], fresh_state.checkpoint_state(0, for_load=True))
        assert (param_digest(fresh), _optim_values(fresh_optim)) == expected and fresh_state.step == 2


def _optim_values(optim: torch.optim.Optimizer) -> list[list[float]]:
    return [[float(v.full_tensor().sum()) if hasattr(v, "full_tensor") else float(v) for v in s.values()]
            for s in optim.state.values()]


def test_freeze_and_target_modules_that_match_nothing_are_config_errors_naming_them(bases):
    with et.Worker(seed=0) as w:
        with pytest.raises(ConfigError, match=r"model.freeze pattern 'model.encoder.\*' matches no parameter; "
                                              r"names look like model.embed_tokens.weight"):
            build_sharded(_job(bases["a"], adapter=False, freeze=("model.encoder.*",)).model, w.mesh,
                          TrainConfig(precision="fp32"), w.device)
        with pytest.raises(ConfigError, match=r"model.lora.target_modules=\['c_attn'\]: .* name modules of this "
                                              r"model \(down_proj, gate_proj, k_proj, lm_head, o_proj"):
            build_sharded(_job(bases["a"], lora=LoraSettings(target_modules=["c_attn"])).model, w.mesh,
                          TrainConfig(precision="fp32"), w.device)


def test_a_frozen_layer_checkpoint_exports_only_merged_over_the_base_it_was_trained_on(bases, tmp_path):
    from transformers import AutoModelForCausalLM

    from elastictrain.checkpoint.discovery import find_latest_valid
    from elastictrain.checkpoint.export_peft import export_checkpoint
    from elastictrain.checkpoint.storage import open_storage
    from elastictrain.errors import CheckpointError

    digest = _run(_job(bases["a"], adapter=False, freeze=("model.embed_tokens.*", "model.layers.0.*")),
                  tmp_path / "ck", 2)
    storage = open_storage(str(tmp_path / "ck"))
    info = find_latest_valid(storage, verify=True)
    with pytest.raises(CheckpointError, match="holds only the trained tensors .* pass --merged"):
        export_checkpoint(storage, info, str(tmp_path / "out"))
    with pytest.raises(CheckpointError, match=f"the base model at '{bases['b']}' is not the one checkpoint .* was "
                                              f"trained on .*; pass --base DIR with that model"):
        export_checkpoint(storage, info, str(tmp_path / "out"), merged=True, base=str(bases["b"]))
    export_checkpoint(storage, info, str(tmp_path / "out"), merged=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert param_digest(merged) == digest, "the base's frozen tensors and the trained ones, bitwise"
