"""Clear one-line errors (exit 2) from the operator CLI: no such run, etcd unreachable, authentication failure."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastictrain.agent.status import EtcdStatusPublisher
from elastictrain.cli.main import main
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.settings import EtcdSettings


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_no_such_run_names_the_run_and_the_runs_that_exist(etcd_private, run_id, capsys):
    etcd = etcd_private  # its own: the hint names at most 10 runs, and other tests' runs would crowd this one out
    settings = EtcdSettings.from_conf(etcd.endpoint, run_id, {})
    client = EtcdClient(settings)
    client.connect()
    try:
        EtcdStatusPublisher(client, settings.run_prefix, "n1").publish()
        rc, _, err = _run(capsys, "status", "--endpoint", etcd.endpoint, "--run-id", "no-such-run")
        assert rc == 2
        assert err.startswith("elastictrain: error: no run 'no-such-run' at etcd ") and run_id in err
        assert err.count("\n") == 1
        rc, _, err = _run(capsys, "events", "--endpoint", etcd.endpoint, "--run-id", "no-such-run")
        assert rc == 2 and "no run 'no-such-run'" in err
    finally:
        client.delete_prefix(settings.run_prefix)
        client.close()


def test_unreachable_etcd_fails_within_seconds_naming_the_endpoint(capsys):
    start = time.monotonic()
    rc, _, err = _run(capsys, "status", "--endpoint", "127.0.0.1:9", "--run-id", "x")
    assert rc == 2 and "cannot reach etcd at http://127.0.0.1:9" in err
    assert time.monotonic() - start < 10


def test_missing_endpoint_or_run_id_says_where_they_come_from(capsys, monkeypatch):
    monkeypatch.delenv("ELASTICTRAIN_ENDPOINT", raising=False)
    rc, _, err = _run(capsys, "status", "--run-id", "x")
    assert rc == 2 and "no etcd endpoint: pass --endpoint" in err


@pytest.mark.slow
def test_authentication_failure_is_named(etcd_private, run_id, capsys):
    etcdctl = str(Path(sys.executable).parent / "etcdctl")
    for args in (["user", "add", "root:rootpw"], ["auth", "enable"]):
        subprocess.run([etcdctl, f"--endpoints={etcd_private.endpoint}", *args], check=True, capture_output=True,
                       timeout=20)
    rc, _, err = _run(capsys, "status", "--endpoint", etcd_private.endpoint, "--run-id", run_id,
                      "--rdzv-conf", "user=root,password=wrong")
    assert rc == 2 and "authentication failed" in err.lower() and "user=... password=..." in err
    rc, _, err = _run(capsys, "status", "--endpoint", etcd_private.endpoint, "--run-id", run_id,
                      "--rdzv-conf", "user=root,password=rootpw")
    assert rc == 2 and f"no run '{run_id}'" in err  # authenticated: on to the next question
