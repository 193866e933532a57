"""Which job a command talks to: flags, then --config, then the environment (elastictrain/cli/target.py)."""

import argparse

import pytest

from elastictrain.cli.target import add_target_args, parse_conf, resolve
from elastictrain.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_target_args(p)
    return p.parse_args(list(argv))


def test_flags_win_over_config_and_config_over_environment(tmp_path, monkeypatch):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("elastic:\n  rdzv_endpoint: etcd-a:2379\n  run_id: from-config\n")
    monkeypatch.setenv("ELASTICTRAIN_ENDPOINT", "env:2379")
    monkeypatch.setenv("ELASTICTRAIN_RUN_ID", "from-env")
    assert resolve(_args("--config", str(cfg))) == ("etcd-a:2379", "from-config")
    assert resolve(_args("--config", str(cfg), "--run-id", "flag")) == ("etcd-a:2379", "flag")
    assert resolve(_args()) == ("env:2379", "from-env")


def test_missing_endpoint_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("ELASTICTRAIN_ENDPOINT", raising=False)
    with pytest.raises(ConfigError, match="no etcd endpoint: pass --endpoint"):
        resolve(_args("--run-id", "r"))


def test_rdzv_conf_parses_like_elastictrain_run():
    assert parse_conf("user=u, password=p,cacert=/ca.pem") == {"user": "u", "password": "p", "cacert": "/ca.pem"}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_conf("user")
