"""`elastictrain run`'s mapping of the config's `elastic` section onto torchrun flags and `--rdzv-conf` keys."""

from __future__ import annotations

from pathlib import Path

from elastictrain.agent.job import torchrun_argv
from elastictrain.config import load_config

CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "tiny-cpu.yaml")


def _rdzv_conf(argv: list[str]) -> dict[str, str]:
    conf = next(a.split("=", 1)[1] for a in argv if a.startswith("--rdzv-conf="))
    return dict(kv.split("=", 1) for kv in conf.split(","))


def test_the_elastic_section_sets_lease_join_grace_and_rejoin_wait():
    overrides = ["elastic.lease_ttl_s=3", "elastic.join_grace_s=4.5", "elastic.rejoin_wait_s=2"]
    cfg = load_config(CONFIG, overrides)
    argv = torchrun_argv(cfg, CONFIG, overrides, [], "127.0.0.1:2379")
    assert _rdzv_conf(argv) == {"lease_ttl": "3", "last_call_timeout": "4.5", "rejoin_wait": "2",
                                "join_timeout": str(int(cfg.elastic.rdzv_timeout_s))}
    assert argv[-2 * len(overrides):] == [x for o in overrides for x in ("--set", o)]


def test_a_user_rdzv_conf_replaces_the_derived_keys():
    cfg = load_config(CONFIG, [])
    argv = torchrun_argv(cfg, CONFIG, [], ["--rdzv-conf", "lease_ttl=2"], "127.0.0.1:2379")
    assert not any(a.startswith("--rdzv-conf=") for a in argv)
    assert argv[argv.index("--rdzv-conf") + 1] == "lease_ttl=2"
