import logging
import os

from elastictrain.checkpoint.discovery import find_latest_valid, list_checkpoints, open_checkpoint, verify_files
from elastictrain.checkpoint.manifest import MANIFEST_NAME, MARKER_NAME
from elastictrain.checkpoint.storage import open_storage


def _data_file(storage, d):
    return storage.path(d, "__0_0.distcp")


def test_newest_committed_checkpoint_is_found(storage, make_checkpoint):
    for s in (10, 20, 30):
        make_checkpoint(s)
    info = find_latest_valid(storage, verify=True)
    assert info.step == 30 and info.valid and info.manifest.metadata.step == 30
    assert [c.step for c in list_checkpoints(storage)] == [30, 20, 10]


def test_torn_checkpoint_without_marker_is_skipped_with_a_warning(storage, make_checkpoint, caplog):
    make_checkpoint(10)
    d = make_checkpoint(20)
    os.remove(storage.path(d, MARKER_NAME))
    with caplog.at_level(logging.WARNING):
        info = find_latest_valid(storage)
    assert info.step == 10
    assert "step-00000020" in caplog.text and "no commit marker" in caplog.text


def test_flipped_byte_in_a_shard_is_detected_by_checksum_and_skipped(storage, make_checkpoint, caplog):
    make_checkpoint(10)
    d = make_checkpoint(20)
    with open(_data_file(storage, d), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))
    # Sizes still match: only a checksum finds it.
    assert find_latest_valid(storage, verify=False).step == 20
    with caplog.at_level(logging.WARNING):
        assert find_latest_valid(storage, verify=True).step == 10
    assert "sha256 mismatch" in caplog.text


def test_truncated_shard_is_detected_from_the_listing_alone(storage, make_checkpoint):
    make_checkpoint(10)
    d = make_checkpoint(20)
    size = os.path.getsize(_data_file(storage, d))
    os.truncate(_data_file(storage, d), size - 7)
    infos = {c.step: c for c in list_checkpoints(storage)}
    assert infos[20].status == "corrupt" and "truncated" in infos[20].reason
    assert find_latest_valid(storage, verify=False).step == 10


def test_missing_shard_and_missing_dcp_metadata_are_detected(storage, make_checkpoint):
    make_checkpoint(10)
    d20 = make_checkpoint(20)
    d30 = make_checkpoint(30)
    os.remove(_data_file(storage, d20))
    os.remove(storage.path(d30, ".metadata"))
    infos = {c.step: c for c in list_checkpoints(storage)}
    assert "missing file __0_0.distcp" in infos[20].reason
    assert "missing file .metadata" in infos[30].reason
    assert find_latest_valid(storage).step == 10


def test_manifest_edited_after_commit_no_longer_matches_the_marker(storage, make_checkpoint):
    make_checkpoint(10)
    d = make_checkpoint(20)
    p = storage.path(d, MANIFEST_NAME)
    open(p, "ab").write(b" ")
    infos = {c.step: c for c in list_checkpoints(storage)}
    assert infos[20].status == "corrupt" and "marker" in infos[20].reason
    assert find_latest_valid(storage).step == 10


def test_no_valid_checkpoint_gives_none_and_unrelated_files_are_ignored(storage, make_checkpoint):
    d = make_checkpoint(5)
    os.remove(storage.path(d, MARKER_NAME))
    os.makedirs(storage.path("notes"), exist_ok=True)
    open(storage.path("notes", "x.txt"), "w").write("hi")
    assert find_latest_valid(storage) is None
    assert find_latest_valid(open_storage(storage.path("does-not-exist"))) is None


def test_open_checkpoint_by_url_and_verify_files_report_problems(storage, make_checkpoint):
    d = make_checkpoint(7)
    info = open_checkpoint(open_storage(storage.url_for(d)), verify=True)
    assert info.valid and info.step == 7
    with open(_data_file(storage, d), "r+b") as f:
        f.write(b"\x00\x00\x00")
    assert verify_files(storage, info) == ["__0_0.distcp: sha256 mismatch (corrupt)"]
