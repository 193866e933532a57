import subprocess
import sys
from pathlib import Path

import pytest

from elastictrain.config import JobConfig, fingerprint_parts, load_config
from elastictrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_shipped_configs_load_and_validate(tmp_path):
    import yaml
    from transformers import LlamaConfig

    # The fine-tuning configs name a model directory on the user's disk (or made by a command): a stand-in here.
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=256).save_pretrained(tmp_path)
    for p in sorted((REPO / "configs").glob("*.yaml")):
        named = (yaml.safe_load(p.read_text()).get("model") or {}).get("path")
        assert isinstance(load_config(p, [f"model.path={tmp_path}"] if named else []), JobConfig), p


def test_overrides_are_typed_and_applied():
    cfg = load_config(REPO / "configs/tiny-cpu.yaml", ["train.steps=7", "optim.lr=1e-4", "checkpoint.url=null",
                                                       "checkpoint.every_steps=0", "model.overrides.hidden_size=32"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 1e-4 and cfg.checkpoint.url is None
    assert cfg.model.overrides["hidden_size"] == 32
    assert cfg.model.overrides["num_hidden_layers"] == 2  # the rest of the file's overrides survive


@pytest.mark.parametrize("text, overrides, must_name", [
    ("train:\n  stpes: 10\n", [], "train.stpes"),                      # unknown key (typo)
    ("bogus: {}\n", [], "bogus"),                                      # unknown section
    ("train:\n  steps: ten\n", [], "train.steps"),                     # wrong type
    ("train:\n  steps: 0\n", [], "train.steps"),                       # steps <= 0
    ("", ["train.steps=-5"], "train.steps"),
    ("data:\n  global_batch_size: 10\n  micro_batch_size: 4\n", [], "micro_batch_size"),
    ("elastic:\n  min_nodes: 3\n  max_nodes: 2\n", [], "min_nodes"),
    ("train:\n  precision: fp8\n", [], "train.precision"),
    ("checkpoint:\n  every_steps: 10\n", [], "checkpoint.url"),
    ("data:\n  source: text\n", [], "data.path"),
    ("data:\n  source: jsonl\n", [], "data.path"),
    ("data:\n  source: parquet\n  path: d.parquet\n", [], "data.tokenizer"),    # nor model.path
    ("", ["data.tokenizer=/models/tok"], "data.tokenizer"),                  # the synthetic source reads no text
    ("data:\n  source: jsonl\n  path: d.jsonl\n  tokenizer: t\n  format: text\n  text_field: ''\n", [],
     "data.text_field"),
    ("", ["data.format=markdown"], "data.format"),
    ("optim:\n  betas: [0.9]\n", [], "optim.betas"),
    ("train: [1, 2]\n", [], "train"),
    ("model:\n  path: /nonexistent/model\n", [], "model.path"),
    ("train:\n  steps: [\n", [], "not valid YAML"),
    ("", ["train.steps"], "section.field=value"),
    ("", ["elastic.rejoin_wait_s=-1"], "rejoin_wait_s"),
    ("", ["elastic.join_grace_s=0"], "join_grace_s"),
    ("", ["elastic.straggler_replace_after_steps=0"], "elastic.straggler_replace_after_steps"),
    ("", ["elastic.straggler_drain_window_s=-1"], "elastic.straggler_drain_window_s"),
    ("", ["elastic.replace_stragglers=sometimes"], "elastic.replace_stragglers"),
    ("", ["checkpoint.storage_wait_s=900"], "checkpoint.storage_wait_s"),
    # the timeout hierarchy: each pair that nests the wrong way names both settings
    ("", ["elastic.hang.floor_s=700"], "train.collective_timeout_s"),
    ("", ["elastic.lease_ttl_s=200"], "elastic.rdzv_timeout_s"),
    ("", ["elastic.join_grace_s=150"], "elastic.rdzv_timeout_s"),
    ("", ["elastic.rejoin_wait_s=30"], "elastic.join_grace_s"),
])
def test_bad_config_names_the_field_and_the_fix(tmp_path, text, overrides, must_name):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), overrides)
    msg = str(e.value)
    assert must_name in msg
    assert "\n" not in msg


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_cli_reports_bad_config_in_one_line_without_traceback(tmp_path):
    p = write(tmp_path, "data:\n  global_batch_size: 10\n  micro_batch_size: 4\n")
    r = subprocess.run([sys.executable, "-m", "elastictrain.cli.main", "run", "--config", str(p)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "data.global_batch_size=10" in lines[0], r.stderr


def test_fingerprint_changes_with_model_shape_not_with_steps():
    a = load_config(None, ["train.steps=10"])
    b = load_config(None, ["train.steps=20"])
    c = load_config(None, ["model.overrides.hidden_size=128"])
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint()["model"] != c.fingerprint()["model"]


def test_the_storage_wait_defaults_below_the_collective_timeout(tmp_path):
    # rank 0's start-up wait for unreachable storage must end before the other ranks' collective times out
    assert load_config(write(tmp_path, ""), []).checkpoint.storage_wait_s == 300
    short = load_config(write(tmp_path, ""), ["train.collective_timeout_s=120"])
    assert short.checkpoint.storage_wait_s == 60


def test_the_hang_settings_are_a_yaml_section_and_the_old_floor_name_still_reads_with_a_warning(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("elastic:\n  hang:\n    floor_s: 4\n    startup_timeout_s: 9\n")
    hang = load_config(cfg).elastic.hang
    assert (hang.floor_s, hang.startup_timeout_s, hang.expect_heartbeats) == (4, 9, None)
    cfg.write_text("elastic:\n  heartbeat_timeout_s: 7\n")
    with pytest.warns(FutureWarning, match="elastic.hang.floor_s"):
        elastic = load_config(cfg).elastic
    assert elastic.hang.floor_s == 7 and elastic.heartbeat_timeout_s is None


def test_a_script_reads_only_the_elastic_section(tmp_path):
    from elastictrain.config import load_elastic

    cfg = tmp_path / "job.yaml"
    cfg.write_text("elastic:\n  nproc_per_node: 3\nmy_script_section: {anything: 1}\n")
    assert load_elastic(cfg, ["elastic.max_restarts=9"]).nproc_per_node == 3
    assert load_elastic(cfg, ["elastic.max_restarts=9"]).max_restarts == 9
    with pytest.raises(ConfigError, match="elastic.hang.floor_s must be >= 0"):
        load_elastic(cfg, ["elastic.hang.floor_s=-1"])


def test_the_data_fingerprint_of_the_older_sources_ignores_the_dataset_fields():
    # the data section as it was before the jsonl/parquet/hf_disk fields: its checkpoints must still resume
    old = {"source": "text", "path": "sample", "token_dtype": "uint16", "seq_len": 64, "global_batch_size": 16,
           "micro_batch_size": 4, "synthetic_samples": 1_000_000}
    cfg = load_config(None, ["data.source=text", "data.path=sample"])
    assert cfg.fingerprint()["data"] == fingerprint_parts({"data": old})["data"]
    packed = load_config(None, ["data.source=jsonl", "data.path=d.jsonl", "data.tokenizer=tok"])
    assert packed.fingerprint()["data"] != load_config(None, ["data.source=jsonl", "data.path=d.jsonl",
                                                               "data.tokenizer=tok", "data.packing=false"]
                                                       ).fingerprint()["data"]
