"""Delta checkpoints (checkpoint.dedup) and compression in one process: unchanged tensors stored once and
referenced, retention keeping exactly the referenced blobs, verify following references, corruption caught,
zstd round trips, and a load at another world size reading blobs."""

import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from elastictrain.checkpoint import blobs
from elastictrain.checkpoint.discovery import list_checkpoints, verify_files
from elastictrain.checkpoint.manager import CheckpointManager
from elastictrain.checkpoint.reader import BlobReader
from elastictrain.cli.main import main as cli_main
from elastictrain.config import CheckpointConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FROZEN = torch.randn(512, 256)  # 512 KiB: a blob (>= DEDUP_MIN_BYTES)


def state(step: int, frozen: torch.Tensor = FROZEN) -> dict:
    """A frozen tensor, a trained one (changes every step), a small one (stays in the rank file) and plain state."""
    return {"model": {"frozen": frozen.clone(), "trained": torch.full((512, 256), float(step)),
                      "norm": torch.full((16,), float(step))},
            "trainer": {"step": step}}


def empty() -> dict:
    return {"model": {"frozen": torch.zeros(512, 256), "trained": torch.zeros(512, 256), "norm": torch.zeros(16)},
            "trainer": {"step": -1}}


def save_steps(root, steps, **cfg) -> CheckpointManager:
    m = CheckpointManager(CheckpointConfig(url=str(root), async_save=False, **cfg), fingerprint={})
    for step in steps:
        assert m.save(step, state(step), blocking=True)
    m.close()
    return m


def blob_files(m: CheckpointManager) -> dict[str, int]:
    return {n: s for n, s in m.storage.list_files().items() if blobs.is_blob(n)}


def load(root, **cfg) -> tuple[dict, int]:
    st = empty()
    loaded = CheckpointManager(CheckpointConfig(url=str(root), **cfg), fingerprint={}).load_latest(st)
    return st, loaded.step


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_an_unchanged_tensor_is_stored_once_and_every_checkpoint_loads_it(tmp_path, compression):
    m = save_steps(tmp_path / "ck", [1, 2, 3], dedup=True, compression=compression, keep_last=5)
    found = blob_files(m)
    # The frozen tensor once, the trained one once per step; the small tensor is not a blob.
    assert len(found) == 4
    infos = {c.step: c for c in list_checkpoints(m.storage)}
    assert all(c.valid and c.manifest.format == 2 for c in infos.values())
    frozen_refs = {b.name for c in infos.values() for b in c.manifest.blobs} - {
        b.name for c in infos.values() for b in c.manifest.blobs if "trained" in b.name}
    shared = set.intersection(*({b.name for b in c.manifest.blobs} for c in infos.values()))
    assert len(shared) == 1 and shared <= frozen_refs  # every checkpoint references the same frozen blob
    assert all(n.endswith(".zst") == (compression == "zstd") for n in found)
    st, step = load(tmp_path / "ck")
    assert step == 3 and st["trainer"] == {"step": 3}
    assert torch.equal(st["model"]["frozen"], FROZEN)
    assert torch.equal(st["model"]["trained"], state(3)["model"]["trained"])
    assert torch.equal(st["model"]["norm"], torch.full((16,), 3.0))


def test_compression_alone_round_trips_and_shrinks_compressible_data(tmp_path):
    plain = save_steps(tmp_path / "plain", [1])
    packed = save_steps(tmp_path / "zstd", [1], compression="zstd")
    size = lambda m: sum(c.nbytes for c in list_checkpoints(m.storage))  # noqa: E731
    assert size(packed) < size(plain)  # the constant "trained" tensor compresses; random data does not
    assert verify_files(packed.storage, list_checkpoints(packed.storage)[0]) == []
    st, _ = load(tmp_path / "zstd")
    assert torch.equal(st["model"]["frozen"], FROZEN)
    assert torch.equal(st["model"]["trained"], state(1)["model"]["trained"])


def test_retention_keeps_blobs_a_kept_checkpoint_references_and_deletes_the_rest(tmp_path):
    m = save_steps(tmp_path / "ck", [1, 2, 3, 4], dedup=True, keep_last=2)
    kept = list_checkpoints(m.storage)
    assert [c.step for c in kept] == [4, 3]
    referenced = {b.name for c in kept for b in c.manifest.blobs}
    # Steps 1 and 2 were deleted: their "trained" blobs with them; the frozen one (referenced by 3 and 4) stays.
    assert set(blob_files(m)) == referenced and len(referenced) == 3
    st, step = load(tmp_path / "ck")
    assert step == 4 and torch.equal(st["model"]["frozen"], FROZEN)


def test_a_blob_left_by_a_save_that_never_committed_is_collected_at_the_next_commit(tmp_path):
    m = save_steps(tmp_path / "ck", [1], dedup=True)
    blobs.write_blob(m.storage, blobs.blob_name("0" * 64, False), b"orphan")
    save_steps(tmp_path / "ck", [2], dedup=True)
    assert blobs.blob_name("0" * 64, False) not in blob_files(m)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_verify_follows_references_and_catches_a_corrupt_or_missing_blob(tmp_path, capsys, compression):
    m = save_steps(tmp_path / "ck", [1, 2], dedup=True, compression=compression, keep_last=5)
    assert cli_main(["ckpt", "verify", str(tmp_path / "ck")]) == 0
    newest = list_checkpoints(m.storage)[0]
    shared = next(b for b in newest.manifest.blobs
                  if all(b.name in {x.name for x in c.manifest.blobs} for c in list_checkpoints(m.storage)))
    path = m.storage.path(shared.name)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum shows it
    with open(path, "wb") as f:
        f.write(data)
    capsys.readouterr()
    assert cli_main(["ckpt", "verify", "--json", str(tmp_path / "ck")]) == 1
    report = json.loads(capsys.readouterr().out)
    # The shared blob is corrupt for both checkpoints that reference it, and named from the root.
    assert [c["status"] for c in report["checkpoints"]] == ["corrupt", "corrupt"]
    assert all(c["problems"][0]["file"] == shared.name for c in report["checkpoints"])
    os.remove(path)
    assert all(not c.valid and "missing blob" in c.reason for c in list_checkpoints(m.storage))


def test_resume_skips_a_checkpoint_whose_blob_is_corrupt_for_an_older_intact_one(tmp_path):
    m = save_steps(tmp_path / "ck", [1, 2], dedup=True, keep_last=5)
    newest = list_checkpoints(m.storage)[0]
    trained = [b for b in newest.manifest.blobs
               if b.name not in {x.name for x in list_checkpoints(m.storage)[1].manifest.blobs}]
    path = m.storage.path(trained[0].name)
    data = bytearray(open(path, "rb").read())
    data[-100] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)
    st, step = load(tmp_path / "ck")
    assert step == 1 and torch.equal(st["model"]["trained"], state(1)["model"]["trained"])


def test_dcp_metadata_points_items_at_their_blobs_and_a_plain_dcp_load_reads_them(tmp_path):
    """DCP's own metadata names `../blobs/<sha256>` per large item: any DCP load (the resharding one at another
    world size included, tests/integration/test_sft.py) reads blobs like rank files."""
    m = save_steps(tmp_path / "ck", [1], dedup=True)
    url = list_checkpoints(m.storage)[0].url
    md = BlobReader(url).read_metadata()
    assert isinstance(md.state_dict_metadata["model.frozen"], TensorStorageMetadata)
    paths = {k.fqn: v.relative_path for k, v in md.storage_data.items()}
    assert paths["model.frozen"].startswith("../blobs/") and paths["model.norm"] == "__0_0.distcp"
    st = {"model": {"frozen": torch.zeros(512, 256)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(st, storage_reader=BlobReader(url), no_dist=True)
    assert torch.equal(st["model"]["frozen"], FROZEN)


def test_zstd_without_zstandard_is_one_clear_config_error(monkeypatch):
    import importlib.util

    from elastictrain.config import load_config
    from elastictrain.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "zstandard" else real(n, *a))
    with pytest.raises(ConfigError, match="zstandard"):
        load_config(None, ["checkpoint.url=/tmp/x", "checkpoint.compression=zstd"])
