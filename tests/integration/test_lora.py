"""LoRA fine-tuning of a pretrained model by the recipe on 2 real ranks (torchrun, gloo): the checkpoint holds the
adapter only (a small fraction of a full one), a stopped run resumes bitwise, and `elastictrain ckpt export` writes
an adapter that peft loads onto the base, and a merged model that transformers loads, both giving the trained
model's logits.

The trained model is rebuilt here from the base and the checkpoint's adapter tensors, the way the recipe holds it
(peft's layers injected into the transformers model); its parameters' digest equals the one the run reported, so
its logits are the trained model's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elastictrain.runtime.train_state import param_digest
from tests.integration.recipe_runs import FAST, REPO, assert_same_train_state, ledger_max_step, run_recipe, worker_env

pytestmark = pytest.mark.slow

# Large enough for the base to dominate a full checkpoint (~0.35M parameters), small enough for a CPU.
SIZES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=256, max_position_embeddings=64)
STEPS = 6


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("lora") / "base"
    AutoModelForCausalLM.from_config(LlamaConfig(**SIZES, tie_word_embeddings=True)).save_pretrained(
        path, safe_serialization=True)
    return path


def _overrides(base: Path, ckpt: Path, lora: bool = True) -> list[str]:
    return ["model.overrides={}", f"model.path={base}", "model.init=pretrained", f"train.steps={STEPS}",
            f"checkpoint.url={ckpt}", "checkpoint.every_steps=2", "checkpoint.keep_last=10", "optim.lr=0.02",
            *(["model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj]"] if lora else [])]


def _bytes(step_dir: Path) -> int:
    return sum(f.stat().st_size for f in step_dir.iterdir())


def _step(ckpt: Path, step: int) -> Path:
    return ckpt / f"step-{step:08d}"


def _cli(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "elastictrain.cli.main", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env={**worker_env(), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _trained_model(base: Path, ckpt_step: Path) -> torch.nn.Module:
    """The recipe's model after training, on one CPU: the base, peft's layers injected, the saved adapter loaded."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    from elastictrain.checkpoint.discovery import list_checkpoints
    from elastictrain.checkpoint.export import load_model_state
    from elastictrain.checkpoint.storage import open_storage

    storage = open_storage(str(ckpt_step.parent))
    info = next(c for c in list_checkpoints(storage) if c.url.endswith(ckpt_step.name))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), model)
    adapter = load_model_state(storage, info)
    result = model.load_state_dict(adapter, strict=False)
    assert not result.unexpected_keys and len(adapter) == 8
    return model.eval()


@pytest.fixture(scope="module")
def straight(base, tmp_path_factory) -> tuple[dict, Path]:
    """An uninterrupted LoRA run: its summary and its checkpoint root."""
    out = tmp_path_factory.mktemp("straight")
    summary = run_recipe(out, 2, _overrides(base, out / "ckpt"))
    assert summary["final_step"] == STEPS
    return summary, out / "ckpt"


def test_lora_checkpoints_are_small_resume_bitwise_and_export_to_peft_and_merged(base, straight, tmp_path):
    straight, straight_ckpt = straight

    # Stopped after step 3 (saved on the way out), resumed at the same world size: bitwise the same run.
    split = _overrides(base, tmp_path / "split_ckpt")
    first = run_recipe(tmp_path / "split", 2, [*split, "train.stop_at=3"])
    assert first["final_step"] == 3
    resumed = run_recipe(tmp_path / "split", 2, split)
    assert resumed["start_step"] == 3 and resumed["resumed_from"]
    assert_same_train_state(resumed, straight)

    # Full fine-tuning of the same model for comparison: the adapter's checkpoint is a small fraction of it.
    run_recipe(tmp_path / "full", 2, [*_overrides(base, tmp_path / "full_ckpt", lora=False), "train.stop_at=2"])
    lora_bytes, full_bytes = _bytes(_step(straight_ckpt, 2)), _bytes(_step(tmp_path / "full_ckpt", 2))
    assert lora_bytes < 0.1 * full_bytes, f"LoRA checkpoint {lora_bytes} B vs full {full_bytes} B"

    trained = _trained_model(base, _step(straight_ckpt, STEPS))
    assert param_digest(trained) == straight["param_digest"], "the rebuilt model is the trained one, bitwise"
    _cli("ckpt", "export", str(straight_ckpt), "--out", str(tmp_path / "adapter"))
    _cli("ckpt", "export", str(straight_ckpt), "--out", str(tmp_path / "merged"), "--merged")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, SIZES["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        want = trained(input_ids=tokens).logits
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                                tmp_path / "adapter").eval()(input_ids=tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        merged_logits = merged(input_ids=tokens).logits
        base_logits = plain(input_ids=tokens).logits
    assert (want - base_logits).abs().max() > 1e-3, "the adapter changed the model (else the comparison is empty)"
    torch.testing.assert_close(peft_logits, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged_logits, want, rtol=1e-4, atol=1e-4)
    assert not any("lora" in name for name, _ in merged.named_parameters())


def test_a_lora_worker_killed_under_the_agent_resumes_from_its_in_memory_snapshot_bitwise(base, straight, etcd,
                                                                                           run_id, tmp_path):
    """Snapshots hold the adapter only too; the restarted workers fill the base from model.path, then the
    snapshot's adapter and optimizer state over it, and end equal to the uninterrupted run."""
    from elastictrain.chaos.process_signals import signal_worker

    out = tmp_path / "run"
    overrides = [*FAST, *_overrides(base, out / "ckpt"), f"train.output_dir={out}", "checkpoint.every_steps=4",
                 "checkpoint.snapshot_every_steps=1", "train.audit_samples=true"]
    cmd = [sys.executable, "-m", "elastictrain.cli.main", "run", "--config", str(REPO / "configs/tiny-cpu.yaml"),
           *(x for o in overrides for x in ("--set", o)), "--nproc-per-node", "2", "--max-restarts", "2",
           "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id]
    out.mkdir()
    with open(out / "agent.log", "w") as log:
        # The last step (index 5) starts 3 s late: the kill lands in that pause, after step 5's snapshot (newer than
        # the durable step 4) and before the last step and the final save. The sample ledger names a step when it is
        # computed (index 4 = the fifth step), before its snapshot: hence the wait of 1 s after seeing it.
        proc = subprocess.Popen(cmd, cwd=REPO, env={**worker_env(), "ELASTICTRAIN_CHAOS": "slow@ms=3000,step=5"},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while ledger_max_step(out) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, (out / "agent.log").read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(1.0)
        assert ledger_max_step(out) == 4, "the last step ran before the kill: the test's pause did not hold"
        signal_worker(proc.pid, signal.SIGKILL, rank=1)
        assert proc.wait(timeout=240) == 0, (out / "agent.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"].startswith("snapshot:") and summary["start_step"] >= 5, summary["resumed_from"]
    assert_same_train_state(summary, straight[0])
