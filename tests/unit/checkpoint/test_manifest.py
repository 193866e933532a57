import hashlib
import io

from elastictrain.checkpoint.manifest import (
    CheckpointMetadata,
    CommitMarker,
    FileEntry,
    HashingWriter,
    Manifest,
    parse_step_dir,
    step_dir_name,
)


def test_step_dir_names_sort_by_step_and_parse_back():
    # Lexical order holds below 10**8 steps; discovery sorts numerically, so larger steps still work.
    names = [step_dir_name(s) for s in (5, 120, 99_999_999)]
    assert names == sorted(names)
    assert [parse_step_dir(n) for n in names + [step_dir_name(10**8)]] == [5, 120, 99_999_999, 10**8]
    assert parse_step_dir("step-12") is None and parse_step_dir("tmp") is None


def test_manifest_and_marker_round_trip_through_json():
    m = Manifest(metadata=CheckpointMetadata(step=3, world_size=2, fingerprint={"model": "ab"},
                                             versions={"torch": "x"}, extra={"hf_config": {"a": 1}}),
                 files=[FileEntry("__0_0.distcp", 10, "00" * 32)])
    assert Manifest.from_bytes(m.to_bytes()) == m
    mk = CommitMarker(step=3, manifest_sha256="ff" * 32)
    assert CommitMarker.from_bytes(mk.to_bytes()) == mk


def test_hashing_writer_records_size_and_sha256_of_what_passed_through():
    seen = []
    raw = io.BytesIO()
    raw.close = lambda: None  # keep the buffer readable after the writer closes it
    w = HashingWriter(raw, "f.bin", seen.append)
    w.write(b"hello ")
    w.write(memoryview(b"world"))
    assert w.tell() == 11
    w.close()
    assert seen == [FileEntry("f.bin", 11, hashlib.sha256(b"hello world").hexdigest())]
    assert raw.getvalue() == b"hello world"
