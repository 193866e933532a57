"""`elastictrain ckpt` on hand-made single-process checkpoints in a temp directory (no services)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastictrain.checkpoint.manifest import MARKER_NAME
from elastictrain.checkpoint.storage import Storage, open_storage
from elastictrain.cli import ckpt
from elastictrain.cli.main import main
from tests.unit.checkpoint.conftest import write_checkpoint

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "ckpts"


@pytest.fixture
def storage(root) -> Storage:
    return open_storage(str(root))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["ckpt", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def flip_byte(path: Path, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def shard(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}" / "__0_0.distcp"


def test_ls_table_lists_every_checkpoint_newest_first_with_status_and_world_size(capsys, storage, root):
    for s in (10, 20, 30):
        write_checkpoint(storage, s)
    os.remove(root / "step-00000030" / MARKER_NAME)
    rc, out, _ = run(capsys, "ls", str(root))
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == f"file://{root}"
    assert lines[1].split()[:4] == ["STEP", "STATUS", "WORLD", "SIZE"]
    assert [ln.split()[:3] for ln in lines[2:]] == [["30", "torn", "-"], ["20", "valid", "1"], ["10", "valid", "1"]]
    assert "no commit marker" in lines[2]


def test_ls_json_reports_torn_and_truncated_from_the_listing_without_reading_data(capsys, storage, root, monkeypatch):
    for s in (1, 2, 3):
        write_checkpoint(storage, s)
    os.truncate(shard(root, 2), shard(root, 2).stat().st_size - 3)
    os.remove(root / "step-00000003" / MARKER_NAME)
    monkeypatch.setattr(ckpt, "verify_files", lambda *a, **k: pytest.fail("ls must not read checksums"))
    monkeypatch.setattr(ckpt, "sha256_stream", lambda *a, **k: pytest.fail("ls must not read data"))
    rc, out, _ = run(capsys, "ls", str(root), "--json")
    assert rc == 0
    doc = json.loads(out)
    by_step = {c["step"]: c for c in doc["checkpoints"]}
    assert [c["step"] for c in doc["checkpoints"]] == [3, 2, 1]
    assert by_step[3]["status"] == "torn" and by_step[3]["world_size"] is None
    assert by_step[2]["status"] == "corrupt" and "truncated" in by_step[2]["reason"]
    files = len(list((root / "step-00000001").iterdir()))
    assert by_step[1]["status"] == "valid" and by_step[1]["world_size"] == 1 and by_step[1]["files"] == files
    assert by_step[1]["bytes"] == sum(p.stat().st_size for p in (root / "step-00000001").iterdir())
    assert by_step[1]["written_at"].endswith("+00:00") and by_step[1]["age_s"] >= 0


def test_verify_reads_every_file_and_names_the_flipped_one_with_expected_and_actual_sha(capsys, storage, root):
    write_checkpoint(storage, 10)
    write_checkpoint(storage, 20)
    rc, out, _ = run(capsys, "verify", str(root))
    assert rc == 0 and "2 of 2 checkpoint(s) valid" in out
    manifest = json.loads((root / "step-00000020" / "manifest.json").read_text())
    expected = next(f["sha256"] for f in manifest["files"] if f["name"] == "__0_0.distcp")
    flip_byte(shard(root, 20))
    rc, out, _ = run(capsys, "verify", str(root))
    assert rc == ckpt.EXIT_PROBLEMS == 1
    assert "step-00000020/__0_0.distcp: sha256 mismatch: expected " + expected in out
    assert "1 of 2 checkpoint(s) valid; bad: 20" in out
    rc, out, _ = run(capsys, "verify", str(root), "--step", "20", "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False and [c["step"] for c in doc["checkpoints"]] == [20]
    (problem,) = doc["checkpoints"][0]["problems"]
    assert problem["file"] == "step-00000020/__0_0.distcp" and problem["expected_sha256"] == expected
    assert problem["actual_sha256"] not in (None, expected)
    assert problem["actual_size"] == problem["expected_size"]
    rc, out, _ = run(capsys, "verify", str(root), "--step", "10")
    assert rc == 0


def test_verify_fails_on_a_torn_checkpoint_and_an_unknown_step_is_an_error(capsys, storage, root):
    write_checkpoint(storage, 10)
    write_checkpoint(storage, 20)
    os.remove(root / "step-00000020" / MARKER_NAME)
    rc, out, _ = run(capsys, "verify", str(root))
    assert rc == 1 and "TORN" in out and "no commit marker" in out
    rc, _, err = run(capsys, "verify", str(root), "--step", "15")
    assert rc == 2 and err.startswith("elastictrain: error: no checkpoint of step 15") and "20, 10" in err


def test_prune_dry_run_lists_what_it_would_delete_and_deletes_nothing(capsys, storage, root):
    for s in (10, 20, 30, 40):
        write_checkpoint(storage, s)
    rc, out, _ = run(capsys, "prune", str(root), "--keep-last", "2", "--dry-run")
    assert rc == 0
    assert "keeping 2 (40, 30), would delete 2" in out
    assert "would delete step 10" in out and "would delete step 20" in out
    assert sorted(p.name for p in root.iterdir()) == [f"step-{s:08d}" for s in (10, 20, 30, 40)]


def test_prune_yes_applies_keep_last_keep_every_and_collects_old_torn_leftovers(capsys, storage, root):
    for s in (10, 15, 20, 30, 40, 50):
        write_checkpoint(storage, s)
    os.remove(root / "step-00000015" / MARKER_NAME)  # a leftover of an interrupted save
    write_checkpoint(storage, 60)
    os.remove(root / "step-00000060" / MARKER_NAME)  # newer than the newest valid: maybe a save in flight
    rc, out, _ = run(capsys, "prune", str(root), "--keep-last", "2", "--keep-every", "20", "--yes")
    assert rc == 0
    assert "torn: no commit marker" in out
    assert f"deleted file://{root}/step-00000015" in out
    assert sorted(p.name for p in root.iterdir()) == [f"step-{s:08d}" for s in (20, 40, 50, 60)]


def test_prune_refuses_without_a_terminal_and_without_yes(capsys, storage, root, monkeypatch):
    for s in (1, 2):
        write_checkpoint(storage, s)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # not a tty, even though it says yes
    rc, _, err = run(capsys, "prune", str(root), "--keep-last", "1")
    assert rc == 2 and "stdin is not a terminal; pass --yes" in err
    assert len(list(root.iterdir())) == 2


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("answer, left", [("n\n", 2), ("yes\n", 1)])
def test_prune_asks_on_a_terminal_and_deletes_only_on_yes(capsys, storage, root, monkeypatch, answer, left):
    for s in (1, 2):
        write_checkpoint(storage, s)
    monkeypatch.setattr(sys, "stdin", _Tty(answer))
    rc, out, _ = run(capsys, "prune", str(root), "--keep-last", "1")
    assert rc == 0 and "Delete 1 checkpoint(s)" in out and "[y/N]" in out
    assert len(list(root.iterdir())) == left


def test_prune_rejects_keep_last_below_one(capsys, storage, root):
    write_checkpoint(storage, 1)
    rc, _, err = run(capsys, "prune", str(root), "--keep-last", "0")
    assert rc == 2 and "--keep-last 0: must be >= 1" in err


@pytest.mark.parametrize("url, message", [
    ("foo://bucket/x", "Protocol not known: foo"),
    ("s3://", "names no bucket"),
    ("{tmp}/missing", "no checkpoints at file://{tmp}/missing (no step-NNNNNNNN directories; the path does not exist)"),
    ("{tmp}", "no checkpoints at file://{tmp} (no step-NNNNNNNN directories; 1 other file(s) there)"),
])
def test_bad_urls_and_empty_roots_are_one_line_errors_with_exit_2(capsys, tmp_path, url, message):
    (tmp_path / "unrelated.txt").write_text("x")
    rc, out, err = run(capsys, "ls", url.format(tmp=tmp_path))
    assert rc == 2 and out == ""
    assert err.startswith("elastictrain: error: ") and err.count("\n") == 1
    assert message.format(tmp=tmp_path) in err


def test_a_single_checkpoint_directory_as_url_says_to_pass_its_parent(capsys, storage, root):
    write_checkpoint(storage, 2)
    rc, _, err = run(capsys, "ls", str(root / "step-00000002"))
    assert rc == 2 and "step-00000002 is one checkpoint, not a checkpoint root; pass its parent" in err


def test_storage_options_nest_on_dots_and_keep_values_as_strings():
    opts = ckpt.parse_storage_options(["endpoint_url=http://127.0.0.1:9000", "key=0123", "anon=false",
                                       "client_kwargs.region_name=eu-west-1", "config_kwargs.connect_timeout=3"])
    assert opts == {"endpoint_url": "http://127.0.0.1:9000", "key": "0123", "anon": False,
                    "client_kwargs": {"region_name": "eu-west-1"}, "config_kwargs": {"connect_timeout": 3}}
    with pytest.raises(ckpt.StorageError, match="expected KEY=VALUE"):
        ckpt.parse_storage_options(["endpoint_url"])


def test_s3_gets_fast_fail_retry_defaults_that_the_user_can_override():
    st = ckpt.open_root("s3://bkt/ckpt", ["endpoint_url=http://127.0.0.1:9", "key=k", "secret=s",
                                          "config_kwargs.retries.max_attempts=5"])
    assert st.options["config_kwargs"]["retries"] == {"max_attempts": 5}
    assert st.options["config_kwargs"]["connect_timeout"] == 10
    assert st.options["endpoint_url"] == "http://127.0.0.1:9"


def test_human_formats():
    assert ckpt.human_bytes(512) == "512 B" and ckpt.human_bytes(1536) == "1.5 KiB"
    assert ckpt.human_bytes(3 * 1024 ** 3) == "3.0 GiB"
    assert [ckpt.human_age(s) for s in (5, 125, 7300, 90000)] == ["5s", "2m5s", "2h1m", "1d1h"]


def test_cli_as_a_subprocess_lists_and_verifies(storage, root):
    write_checkpoint(storage, 7)
    env = dict(os.environ, AWS_EC2_METADATA_DISABLED="true")
    r = subprocess.run([sys.executable, "-m", "elastictrain.cli.main", "ckpt", "ls", str(root)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[2].split()[:2] == ["7", "valid"]
    flip_byte(shard(root, 7))
    r = subprocess.run([sys.executable, "-m", "elastictrain.cli.main", "ckpt", "verify", str(root)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "step-00000007/__0_0.distcp: sha256 mismatch" in r.stdout


def _save_tiny_llama(storage: Storage, step: int):
    """A committed checkpoint shaped like the recipe's: the model under `model`, plus non-model state."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    from elastictrain.checkpoint.commit import CommittingWriter
    from elastictrain.checkpoint.manifest import CheckpointMetadata, step_dir_name

    torch.manual_seed(step)
    cfg = AutoConfig.for_model("llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, vocab_size=64, head_dim=8)
    model = AutoModelForCausalLM.from_config(cfg)
    md = CheckpointMetadata(step=step, world_size=1, extra={"hf_config": model.config.to_dict()})
    writer = CommittingWriter(storage, step_dir_name(step), md)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "trainer": {"step": step}}, storage_writer=writer, no_dist=True)
    return model


def test_export_writes_a_hf_checkpoint_that_loads_with_the_saved_parameters(capsys, storage, root, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    first = _save_tiny_llama(storage, 1)
    _save_tiny_llama(storage, 2)
    out = tmp_path / "hf"
    rc, text, err = run(capsys, "export", str(root), "--out", str(out), "--step", "1")
    assert rc == 0, err
    assert f"exported step 1 from file://{root}/step-00000001 to {out}" in text
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    want = first.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)

    rc, _, _ = run(capsys, "export", str(root), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16")
    assert rc == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").model.norm.weight.dtype == torch.bfloat16


def test_export_refuses_torn_and_corrupt_checkpoints(capsys, storage, root, tmp_path):
    write_checkpoint(storage, 1)
    write_checkpoint(storage, 2)
    os.remove(root / "step-00000002" / MARKER_NAME)
    rc, _, err = run(capsys, "export", str(root), "--out", str(tmp_path / "o"), "--step", "2")
    assert rc == 2 and "step 2" in err and "torn" in err and "no commit marker" in err
    flip_byte(shard(root, 1))
    rc, _, err = run(capsys, "export", str(root), "--out", str(tmp_path / "o"))
    assert rc == 2 and "step-00000001" in err and "__0_0.distcp: sha256 mismatch" in err
    assert not (tmp_path / "o").exists()


def test_ls_verify_marks_a_flipped_byte_corrupt_that_plain_ls_cannot_see(capsys, storage, root):
    write_checkpoint(storage, 1)
    write_checkpoint(storage, 2)
    flip_byte(shard(root, 2))
    rc, out, _ = run(capsys, "ls", str(root), "--json")
    assert [c["status"] for c in json.loads(out)["checkpoints"]] == ["valid", "valid"]
    rc, out, _ = run(capsys, "ls", str(root), "--verify")
    assert rc == 0
    row = out.splitlines()[2]
    assert row.split()[:2] == ["2", "corrupt"] and "__0_0.distcp: sha256 mismatch" in row
