import os

import pytest

from elastictrain.checkpoint.storage import check_storage, open_storage, resolve_options
from elastictrain.errors import StorageError


def test_plain_path_and_file_url_are_the_same_storage(tmp_path):
    a = open_storage(str(tmp_path / "c"))
    b = open_storage(f"file://{tmp_path}/c/")
    assert a.url == b.url == f"file://{tmp_path}/c" and a.root == b.root and a.is_local
    check_storage(a)
    a.write_bytes(b"x", "step-00000001", "f")
    assert b.list_files() == {"step-00000001/f": 1}


def test_other_fsspec_protocols_work_without_code_changes():
    st = open_storage("memory://elastictrain-test/run")
    check_storage(st)
    st.write_bytes(b"abc", "d", "f")
    assert st.list_files() == {"d/f": 3}
    assert st.read_bytes("d", "f") == b"abc"
    st.remove_dir("d")
    assert st.list_files() == {}


def test_unwritable_directory_names_the_url_and_the_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError) as e:
        check_storage(open_storage(str(blocker / "ckpts")))
    assert str(blocker / "ckpts") in str(e.value) and "not writable" in str(e.value)


def test_unknown_protocol_is_a_storage_error():
    with pytest.raises(StorageError, match="nosuchproto"):
        open_storage("nosuchproto://x/y")


def test_s3_options_come_from_aws_environment_when_not_configured(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    opts = resolve_options("s3://b/p")
    assert {k: v for k, v in opts.items() if k != "config_kwargs"} == {
        "endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s", "client_kwargs": {"region_name": "eu-west-3"}}
    # configured options win over the environment
    assert resolve_options("s3://b/p", {"endpoint_url": "http://127.0.0.1:8", "key": "a"})["key"] == "a"
    assert resolve_options("s3://b/p", {"endpoint_url": "http://127.0.0.1:8"})["endpoint_url"].endswith(":8")
    assert resolve_options(os.fspath("/tmp/x")) == {}
