"""Pretrained safetensors weights into the FSDP2 model, on real ranks (gloo on loopback, one OS process each).

The ranks run this file's `__main__` (`python test_pretrained.py <out> <model dirs...>`): they build the recipe's
sharded model on the meta device, load each directory with `load_pretrained`, and write what they loaded (the
full state dict, gathered) and every read they made from the files. World 1 and world 2 run at once.
Every safetensors read goes through safetensors' own `safe_open` (DCP's reader calls nothing else); the ranks
wrap it to log the region each read returned: the library's reads, not a stand-in for our code.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.recipe_runs import FAST, REPO, torchrun_cmd, worker_env

HERE = Path(__file__).resolve()
TIMEOUT_S = 240.0
pytestmark = pytest.mark.slow

# Llama sizes chosen so that dim 0 does not split evenly over 2 ranks (vocab 101: rows 51 + 50).
SIZES = dict(hidden_size=36, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)


# --- the ranks' script --------------------------------------------------------------------------------------


class _LoggedSlice:
    def __init__(self, name: str, inner: Any, log: list[dict[str, Any]]):
        self._name, self._inner, self._log = name, inner, log

    def __getitem__(self, index: Any) -> Any:
        t = self._inner[index]
        first = index[0] if isinstance(index, tuple) else index
        self._log.append({"name": self._name, "row": first.start or 0, "shape": list(t.shape)})
        return t

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


class _LoggedFile:
    """safetensors' `safe_open`, logging each tensor read (a whole tensor is logged as row -1)."""

    log: list[dict[str, Any]] = []

    def __init__(self, *args: Any, **kwargs: Any):
        self._inner = _LoggedFile.real(*args, **kwargs)  # type: ignore[attr-defined]

    def __enter__(self) -> "_LoggedFile":
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)

    def get_slice(self, name: str) -> _LoggedSlice:
        return _LoggedSlice(name, self._inner.get_slice(name), self.log)

    def get_tensor(self, name: str) -> Any:
        t = self._inner.get_tensor(name)
        self.log.append({"name": name, "row": -1, "shape": list(t.shape)})
        return t

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


def _rank_main(out: Path, loads: list[str], failing: list[str]) -> None:
    import safetensors
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    import elastictrain as et
    from elastictrain.config import ModelConfig, TrainConfig
    from elastictrain.errors import ConfigError
    from elastictrain.recipes.model import build_sharded
    from elastictrain.recipes.pretrained import load_pretrained

    _LoggedFile.real = safetensors.safe_open  # type: ignore[attr-defined]
    safetensors.safe_open = _LoggedFile  # type: ignore[misc]
    with et.Worker(seed=0) as w:
        tag = f"w{w.world_size}r{w.rank}"
        for i, path in enumerate(loads):
            model = build_sharded(ModelConfig(path=path, overrides={}), w.mesh, TrainConfig(precision="fp32"),
                                  w.device)
            _LoggedFile.log.clear()
            load_pretrained(model, path)
            held = {n: {"row": int(p.__create_chunk_list__()[0].offsets[0]), "shape": list(p.to_local().shape)}
                    for n, p in model.named_parameters() if isinstance(p, DTensor)}
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if w.rank == 0:
                torch.save(full, out / f"{tag}_{i}.pt")
            (out / f"{tag}_{i}.json").write_text(json.dumps({"reads": _LoggedFile.log, "held": held}))
        errors = []
        for path in failing:
            model = build_sharded(ModelConfig(path=path, overrides={}), w.mesh, TrainConfig(precision="fp32"),
                                  w.device)
            try:
                load_pretrained(model, path)
                errors.append(None)
            except ConfigError as e:
                errors.append(str(e))
        (out / f"{tag}_errors.json").write_text(json.dumps(errors))


# --- fixtures ----------------------------------------------------------------------------------------------


def _save(directory: Path, *, bare: bool, dtype: str, shard_size: str) -> Path:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(len(str(directory)))
    cfg = LlamaConfig(**SIZES, tie_word_embeddings=True)
    model = (AutoModel if bare else AutoModelForCausalLM).from_config(cfg).to(getattr(torch, dtype))
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=shard_size)
    return directory


def _broken(source: Path, directory: Path, change: str) -> Path:
    """A copy of the one-file checkpoint `source` with a tensor removed or cut to another shape."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory.mkdir()
    shutil.copy(source / "config.json", directory / "config.json")
    tensors = load_file(source / "model.safetensors")
    if change == "missing":
        del tensors["layers.1.mlp.up_proj.weight"]
    elif change == "shape":
        tensors["layers.0.self_attn.q_proj.weight"] = tensors["layers.0.self_attn.q_proj.weight"][:30].clone()
    if change != "none":
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A: LlamaForCausalLM in fp32 over several files with an index; B: the bare LlamaModel (no `model.` prefix)
    in bf16 in one file; both with the head tied to the embeddings, as save_pretrained stores them (once)."""
    root = tmp_path_factory.mktemp("pretrained")
    a = _save(root / "a", bare=False, dtype="float32", shard_size="20KB")
    b = _save(root / "b", bare=True, dtype="bfloat16", shard_size="5GB")
    assert (a / "model.safetensors.index.json").exists() and len(list(a.glob("*.safetensors"))) > 3
    return {"a": a, "b": b, "missing": _broken(b, root / "missing", "missing"),
            "shape": _broken(b, root / "shape", "shape"), "none": _broken(b, root / "none", "none")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(out: Path, world: int, args: list[str]) -> list[subprocess.Popen]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICTRAIN_")}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs = []
    for r in range(world):
        env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
        with open(out / f"log_w{world}r{r}.txt", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, str(HERE), str(out), *args], cwd=REPO, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    return procs


@pytest.fixture(scope="module")
def loaded(models, tmp_path_factory) -> Path:
    """World 1 loads A and B; world 2 loads A and B, then tries the three broken directories."""
    out = tmp_path_factory.mktemp("loaded")
    loads = f"{models['a']},{models['b']}"
    failing = f"{models['missing']},{models['shape']},{models['none']}"
    procs = _start(out, 1, [loads, ""]) + _start(out, 2, [loads, failing])
    deadline = time.monotonic() + TIMEOUT_S
    try:
        codes = [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(out.glob("log_*")))
    assert codes == [0, 0, 0], f"exit codes {codes}:\n{logs}"
    return out


def _reference(directory: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()


# --- tests ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2])
def test_every_rank_count_loads_bitwise_what_from_pretrained_loads(models, loaded, world):
    import torch

    for i, name in enumerate(["a", "b"]):  # b: no `model.` prefix in the file, bf16 into fp32 parameters
        ref = _reference(models[name])
        got = torch.load(loaded / f"w{world}r0_{i}.pt")
        assert set(got) == set(ref), f"{name}: keys differ: {set(got) ^ set(ref)}"
        for key, value in ref.items():
            assert got[key].dtype == torch.float32 and torch.equal(got[key], value), f"{name}: {key} differs"


def test_each_rank_reads_exactly_the_rows_of_its_own_shards(models, loaded):
    for i in range(2):
        ranks = [json.loads((loaded / f"w2r{r}_{i}.json").read_text()) for r in range(2)]
        for rank, seen in enumerate(ranks):
            reads = {(r["name"].removeprefix("model."), r["row"], tuple(r["shape"])) for r in seen["reads"]}
            held = {(n.removeprefix("model."), h["row"], tuple(h["shape"])) for n, h in seen["held"].items()
                    if h["shape"][0] > 0}
            assert len(seen["reads"]) == len(reads), f"rank {rank} read a region twice"
            assert reads == held, f"rank {rank} read other regions than its shards: {sorted(reads ^ held)[:4]}"
        # The two ranks' rows are disjoint and together the whole tensor: nobody read the full model.
        embed = [next(r for r in ranks[k]["reads"] if r["name"].endswith("embed_tokens.weight")) for k in (0, 1)]
        assert [(e["row"], e["shape"][0]) for e in embed] == [(0, 51), (51, 50)]


def test_a_missing_tensor_a_wrong_shape_and_no_weights_each_fail_on_every_rank_with_one_line(models, loaded):
    per_rank = [json.loads((loaded / f"w2r{r}_errors.json").read_text()) for r in range(2)]
    assert per_rank[0] == per_rank[1], "every rank fails the same way (no rank left waiting in a collective)"
    missing, shape, none = per_rank[0]
    for message, path in zip(per_rank[0], ("missing", "shape", "none")):
        assert message and "\n" not in message and str(models[path]) in message
    assert "1 of the model's" in missing and "model.layers.1.mlp.up_proj.weight" in missing
    assert "layers.0.self_attn.q_proj.weight: file (30, 36) vs model (36, 36)" in shape
    assert "no *.safetensors weights" in none and "model.init=random" in none


def test_a_resume_loads_its_checkpoint_and_never_reads_the_pretrained_weights(models, tmp_path):
    """The weights are moved away after the first run: the resume (same config, init=pretrained) must not need
    them, and the first run must have loaded them."""
    common = [*FAST, "model.overrides={}", f"model.path={models['a']}", "model.init=pretrained",
              f"checkpoint.url={tmp_path / 'ckpt'}", "checkpoint.every_steps=2", "train.steps=6",
              f"train.output_dir={tmp_path / 'out'}", "logging.level=INFO"]

    def run(extra: list[str]) -> tuple[dict, str]:
        cmd = torchrun_cmd(2, [*common, *extra], log_dir=tmp_path / "torchelastic")
        r = subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True,
                           text=True, timeout=TIMEOUT_S)
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-4000:]}"
        return json.loads((tmp_path / "out" / "summary.json").read_text()), r.stderr

    first, log = run(["train.stop_at=4"])
    assert first["final_step"] == 4 and "loaded 20 pretrained tensors" in log, log[-3000:]
    moved = tmp_path / "weights_moved_away"
    moved.mkdir()
    for f in [*models["a"].glob("*.safetensors"), models["a"] / "model.safetensors.index.json"]:
        f.rename(moved / f.name)
    try:
        resumed, log = run([])
    finally:
        for f in moved.iterdir():
            f.rename(models["a"] / f.name)
    assert resumed["start_step"] == 4 and resumed["final_step"] == 6 and resumed["resumed_from"], log[-3000:]
    assert "pretrained tensors" not in log


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]), [p for p in sys.argv[2].split(",") if p], [p for p in sys.argv[3].split(",") if p])
