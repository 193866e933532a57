"""`elastictrain ckpt` against checkpoints written by a real 2-rank recipe run (torchrun, FSDP2, DCP), on a local
directory and on a real S3 server (`rclone serve s3` on loopback).

One run per storage writes steps 2, 4 and 6 (module scope, ~10-20 s each); tests that change a root work on
a copy of it. The CLI runs as its own process, as an operator runs it: forked from a helper that imported it once
(tests/integration/cli/forked_cli.py), since thirty fresh interpreters would spend two minutes importing torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from elastictrain.checkpoint.storage import Storage, open_storage
from elastictrain.testing.s3server import S3Server
from tests.integration.cli.forked_cli import ForkedCli
from tests.integration.recipe_runs import REPO, run_recipe

pytestmark = pytest.mark.slow

# Blocking saves: an async save due while the previous upload is still in flight is skipped (a slow S3 under load
# took longer than 2 steps here), and these tests need every step's checkpoint.
STEPS = ["train.steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=10", "checkpoint.async_save=false"]


@dataclass
class Root:
    """A checkpoint root as an operator would name it: URL plus the CLI flags and env that reach it."""

    url: str
    flags: list[str]
    env: dict[str, str]
    storage_options: dict[str, Any]

    def storage(self) -> Storage:
        return open_storage(self.url, self.storage_options)


@pytest.fixture(scope="module")
def forked_cli() -> Iterator[ForkedCli]:
    helper = ForkedCli()
    yield helper
    helper.close()


@pytest.fixture
def cli(forked_cli: ForkedCli):
    def run(root: Root, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`python -m elastictrain.cli.main ckpt ARGV URL FLAGS` in a process of its own (stdin: empty, not a
        terminal)."""
        full_env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true", **(env or {})}
        return forked_cli.run(["ckpt", *argv, root.url, *root.flags], cwd=REPO, env=full_env, input="")

    return run


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("local-run")
    summary = run_recipe(out, 2, [*STEPS, f"checkpoint.url={out}/ckpt"])
    return out / "ckpt", summary


@pytest.fixture(scope="module")
def s3_run(s3_server: S3Server, tmp_path_factory) -> tuple[str, dict]:
    bucket = s3_server.make_bucket(f"run-{uuid.uuid4().hex[:8]}")
    out = tmp_path_factory.mktemp("s3-run")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env().items():  # the recipe's workers inherit these (run_recipe copies os.environ)
            mp.setenv(k, v)
        summary = run_recipe(out, 2, [*STEPS, f"checkpoint.url=s3://{bucket}/ckpt"])
    return bucket, summary


def _s3_flags(server: S3Server) -> list[str]:
    return [f"--storage-option=endpoint_url={server.endpoint_url}", f"--storage-option=key={server.access_key}",
            f"--storage-option=secret={server.secret_key}"]


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> Iterator[Root]:
    """A private copy of a run's checkpoints (tests corrupt and prune them)."""
    if request.param == "local":
        src, _ = request.getfixturevalue("local_run")
        shutil.copytree(src, tmp_path / "ckpt")
        yield Root(url=str(tmp_path / "ckpt"), flags=[], env={}, storage_options={})
        return
    server: S3Server = request.getfixturevalue("s3_server")
    bucket, _ = request.getfixturevalue("s3_run")
    copy = f"copy-{uuid.uuid4().hex[:8]}"
    # Copied through S3 (server-side copies): rclone caches directory listings, so files placed in its
    # backing directory behind its back may stay invisible.
    fs = open_storage(f"s3://{bucket}/ckpt", server.storage_options()).fs
    fs.mkdir(copy)
    for src in fs.find(f"{bucket}/ckpt"):
        fs.copy(src, f"{copy}/{src.split('/', 1)[1]}")
    yield Root(url=f"s3://{copy}/ckpt", flags=_s3_flags(server), env={},
               storage_options=server.storage_options())


def _flip_byte(root: Root, name: str, offset: int = 1000) -> None:
    """Flip one byte of an object through the storage itself (a PUT on S3); the size stays the same."""
    st = root.storage()
    data = bytearray(st.read_bytes(name))
    data[offset] ^= 0x01
    st.write_bytes(bytes(data), name)


def test_ls_shows_every_step_of_the_run_valid_with_world_size_2(root, cli):
    r = cli(root, "ls", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [(c["step"], c["status"], c["world_size"], c["files"]) for c in doc["checkpoints"]] == \
        [(6, "valid", 2, 5), (4, "valid", 2, 5), (2, "valid", 2, 5)]
    r = cli(root, "ls")
    assert r.returncode == 0
    assert [ln.split()[:3] for ln in r.stdout.splitlines()[2:]] == [["6", "valid", "2"], ["4", "valid", "2"],
                                                                      ["2", "valid", "2"]]


def test_verify_passes_then_a_flipped_byte_fails_it_naming_the_file_and_ls_verify_shows_corrupt(root, cli):
    r = cli(root, "verify")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 of 3 checkpoint(s) valid" in r.stdout
    _flip_byte(root, "step-00000004/__1_0.distcp")
    r = cli(root, "verify")
    assert r.returncode == 1
    assert "step-00000004/__1_0.distcp: sha256 mismatch: expected " in r.stdout and ", actual " in r.stdout
    assert "2 of 3 checkpoint(s) valid; bad: 4" in r.stdout
    r = cli(root, "ls", "--verify", "--json")
    statuses = {c["step"]: c["status"] for c in json.loads(r.stdout)["checkpoints"]}
    assert statuses == {6: "valid", 4: "corrupt", 2: "valid"}
    r = cli(root, "verify", "--step", "6")
    assert r.returncode == 0


def test_a_truncated_shard_shows_corrupt_in_plain_ls(root, cli):
    st = root.storage()
    data = st.read_bytes("step-00000006/__0_0.distcp")
    st.write_bytes(data[:-10], "step-00000006/__0_0.distcp")
    r = cli(root, "ls")
    row = r.stdout.splitlines()[2]
    assert row.split()[:2] == ["6", "corrupt"] and "__0_0.distcp" in row and "truncated" in row


def test_prune_dry_run_deletes_nothing_and_the_real_one_keeps_the_newest(root, cli):
    r = cli(root, "prune", "--keep-last", "1", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "keeping 1 (6), would delete 2" in r.stdout
    assert "would delete step 2" in r.stdout and "would delete step 4" in r.stdout
    assert len(json.loads(cli(root, "ls", "--json").stdout)["checkpoints"]) == 3
    r = cli(root, "prune", "--keep-last", "1")  # stdin is not a terminal
    assert r.returncode == 2 and "pass --yes" in r.stderr
    r = cli(root, "prune", "--keep-last", "1", "--yes")
    assert r.returncode == 0, r.stderr
    deleted = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("deleted ")]
    assert [d.rsplit("/", 1)[1] for d in deleted] == ["step-00000002", "step-00000004"]
    assert [c["step"] for c in json.loads(cli(root, "ls", "--json").stdout)["checkpoints"]] == [6]


def _digest(state: dict) -> str:
    """The recipe's param_digest (summary.json) of a full state dict."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_export_of_the_last_step_loads_in_transformers_with_the_runs_final_parameters(local_run, tmp_path, cli):
    from transformers import AutoModelForCausalLM

    ckpt, summary = local_run
    out = tmp_path / "hf"
    r = cli(Root(url=str(ckpt), flags=[], env={}, storage_options={}), "export", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"exported step 6 from file://{ckpt}/step-00000006" in r.stdout
    model = AutoModelForCausalLM.from_pretrained(out)
    # The recipe hashed its full (unsharded) parameters at the end of the run, i.e. at step 6.
    assert _digest(model.state_dict()) == summary["param_digest"]


def test_export_of_an_earlier_step_from_s3_equals_a_plain_dcp_load_of_that_step(s3_server, s3_run, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from transformers import AutoConfig, AutoModelForCausalLM

    from elastictrain.cli.main import main

    bucket, _ = s3_run
    out = tmp_path / "hf"
    assert main(["ckpt", "export", f"s3://{bucket}/ckpt", "--out", str(out), "--step", "4",
                 *_s3_flags(s3_server)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    # Independent reference: DCP itself fills a template model of the saved config.
    cfg = json.loads((out / "config.json").read_text())
    template = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).state_dict()
    reader = FsspecReader(f"s3://{bucket}/ckpt/step-00000004", **s3_server.storage_options())
    box = {"model": template}
    dcp.load(box, storage_reader=reader, no_dist=True)
    assert set(exported) == set(template)
    assert all(torch.equal(exported[k], template[k]) for k in template)


def test_s3_credentials_from_the_aws_environment_and_clear_errors(s3_server, s3_run, cli):
    bucket, _ = s3_run
    root = Root(url=f"s3://{bucket}/ckpt", flags=[], env={}, storage_options={})
    r = cli(root, "ls", env=s3_server.env())
    assert r.returncode == 0 and r.stdout.splitlines()[2].split()[:2] == ["6", "valid"]

    def err(url: str, **env: str) -> str:
        r = cli(Root(url=url, flags=[], env={}, storage_options={}), "ls", env={**s3_server.env(), **env})
        assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
        return r.stderr

    assert "refused the credentials" in err(root.url, AWS_SECRET_ACCESS_KEY="wrong")
    dead = f"http://127.0.0.1:{_closed_port()}"
    assert f"S3 endpoint {dead} is unreachable" in err(root.url, AWS_ENDPOINT_URL=dead)
    assert "bucket 'no-such-bucket' does not exist" in err("s3://no-such-bucket/ckpt")
    assert f"no checkpoints at s3://{bucket}/elsewhere" in err(f"s3://{bucket}/elsewhere")


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
