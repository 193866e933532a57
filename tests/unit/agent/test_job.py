"""`elastictrain run`'s settings: one schema (the config's `elastic` section) from YAML, `--set` and flags, the flags
winning; a user's script or module as the worker, or the recipe from `--config` when no script is given."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from elastictrain.agent.job import held_place_s, launch_request, load_settings
from elastictrain.agent.launch import get_args_parser
from elastictrain.agent.spares import FLAGS_WITHOUT_VALUE, RECIPE_MODULE, SCRIPT_PREWARM, RunArgs
from elastictrain.errors import ConfigError

CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "tiny-cpu.yaml")
ETCD = ["--rdzv-endpoint", "127.0.0.1:2379"]


def _request(argv: list[str]):
    run = RunArgs.split(argv)
    return launch_request(run, load_settings(run)[1])


def test_the_elastic_section_sets_lease_join_grace_and_rejoin_wait():
    req = _request(["--config", CONFIG, *ETCD, "--set", "elastic.lease_ttl_s=3", "--set", "elastic.join_grace_s=4.5",
                    "--set", "elastic.rejoin_wait_s=2"])
    conf = req.config.rdzv_configs
    assert (conf["lease_ttl"], conf["last_call_timeout"], conf["rejoin_wait"]) == (3, 4.5, 2)
    assert conf["join_timeout"] == 120


def test_with_pause_in_place_a_lost_nodes_place_is_held_as_long_as_the_rejoin_wait_from_the_config_or_a_flag():
    conf = _request(["--config", CONFIG, *ETCD, "--set", "elastic.in_place=true", "--set", "elastic.join_grace_s=30",
                     "--set", "elastic.rejoin_wait_s=20"]).config.rdzv_configs
    assert conf["in_place_rejoin"] == 20
    conf = _request(["--config", CONFIG, *ETCD, "--set", "elastic.in_place=true", "--rdzv-conf",
                     "last_call_timeout=30,rejoin_wait=25"]).config.rdzv_configs
    assert conf["in_place_rejoin"] == "25"
    assert held_place_s(conf) == 25.0, "the survivors' workers wait in place as long as their agents hold the place"
    conf = _request(["--config", CONFIG, *ETCD, "--set", "elastic.join_grace_s=30",
                     "--set", "elastic.rejoin_wait_s=20"]).config.rdzv_configs
    assert conf["in_place_rejoin"] == 0, "without pause in place a lost node starts a new round"


def test_presence_links_are_on_by_default_and_the_config_or_a_flag_turns_them_off():
    assert _request(["--config", CONFIG, *ETCD]).config.rdzv_configs["presence"] == 1
    conf = _request(["--config", CONFIG, *ETCD, "--set", "elastic.presence_link=false"]).config.rdzv_configs
    assert conf["presence"] == 0
    assert _request(["--config", CONFIG, *ETCD, "--rdzv-conf", "presence=0"]).config.rdzv_configs["presence"] == "0"


@pytest.mark.parametrize("flags,names", [
    (["--rdzv-conf", "lease_ttl=300"], ("rdzv-conf lease_ttl", "rdzv-conf join_timeout")),
    (["--rdzv-conf", "rejoin_wait=20"], ("rdzv-conf rejoin_wait", "rdzv-conf last_call_timeout")),
])
def test_a_flag_that_breaks_the_timeout_hierarchy_is_refused_naming_both(flags, names):
    """The config file's timeouts nest; a flag given on top of it is checked too."""
    with pytest.raises(ConfigError) as e:
        _request(["--config", CONFIG, *ETCD, *flags])
    assert all(n in str(e.value) for n in names) and "\n" not in str(e.value)


def test_a_rdzv_conf_key_given_wins_over_the_one_from_the_config_and_keeps_the_others():
    conf = _request(["--config", CONFIG, *ETCD, "--rdzv-conf", "lease_ttl=2"]).config.rdzv_configs
    assert conf["lease_ttl"] == "2" and conf["last_call_timeout"] == 10


def test_without_a_script_the_recipe_runs_with_the_config_and_its_overrides():
    req = _request(["--config", CONFIG, *ETCD, "--set", "train.steps=5"])
    assert req.entrypoint == sys.executable
    assert req.args == ["-u", "-m", RECIPE_MODULE, "--config", CONFIG, "--set", "train.steps=5"]
    assert req.health.expect_beats  # the recipe beats from its start: the startup rule holds at once
    assert req.prewarm == []  # the recipe's spares import the recipe (and call its prewarm hook)


def test_a_script_runs_with_its_own_arguments_even_ones_named_like_ours(tmp_path: Path):
    req = _request([*ETCD, "--nproc-per-node", "2", "train.py", "--steps", "3", "--config", "mine.yaml",
                    "--set", "lr=1", "--nproc-per-node", "9"])
    assert req.entrypoint == sys.executable
    assert req.args == ["-u", "train.py", "--steps", "3", "--config", "mine.yaml", "--set", "lr=1",
                        "--nproc-per-node", "9"]
    assert req.config.nproc_per_node == 2 and req.config.rdzv_backend == "etcd3"
    assert not req.health.expect_beats  # it may not use our worker API
    assert req.prewarm == list(SCRIPT_PREWARM)


def test_a_module_runs_with_dash_m_and_its_spares_import_what_prewarm_lists():
    req = _request([*ETCD, "--prewarm", "numpy, json", "-m", "mypkg.train", "--lr", "1"])
    assert req.args == ["-u", "-m", "mypkg.train", "--lr", "1"]
    assert req.prewarm == [*SCRIPT_PREWARM, "numpy", "json"]


def test_a_config_with_only_an_elastic_section_sets_the_agent_for_a_script(tmp_path: Path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("elastic:\n  nproc_per_node: 3\n  max_restarts: 7\n  run_id: mine\n  min_nodes: 1\n"
                   "  max_nodes: 2\n  rdzv_endpoint: 127.0.0.1:2379\n  prewarm: [numpy]\n"
                   "  hang: {floor_s: 4, startup_timeout_s: 9, expect_heartbeats: true}\n")
    run = RunArgs.split(["--config", str(cfg), "train.py"])
    job, elastic = load_settings(run)
    assert job is None  # a script owns its training config
    req = launch_request(run, elastic)
    c = req.config
    assert (c.nproc_per_node, c.max_restarts, c.run_id, c.min_nodes, c.max_nodes) == (3, 7, "mine", 1, 2)
    assert c.rdzv_endpoint == "127.0.0.1:2379"
    h = req.health
    assert h.hang_floor_s == 4 and h.startup_timeout_s == 9 and h.expect_beats
    assert req.prewarm == [*SCRIPT_PREWARM, "numpy"]


def test_flags_win_over_the_yaml_and_set_wins_over_the_file(tmp_path: Path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("elastic:\n  nproc_per_node: 3\n  max_restarts: 7\n  run_id: mine\n  warm_spares: true\n"
                   "  hang: {floor_s: 4}\n")
    req = _request(["--config", str(cfg), "--set", "elastic.max_restarts=5", *ETCD, "--nproc-per-node", "1",
                    "--rdzv-id", "theirs", "--heartbeat-timeout", "2", "--no-warm-spares", "--no-expect-heartbeats",
                    "train.py"])
    c = req.config
    assert (c.nproc_per_node, c.max_restarts, c.run_id) == (1, 5, "theirs")
    assert req.health.hang_floor_s == 2 and not req.warm_spares and not req.health.expect_beats


def test_heartbeat_timeout_zero_in_the_yaml_turns_hang_detection_off(tmp_path: Path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("elastic:\n  hang:\n    floor_s: 0\n")
    assert not _request(["--config", str(cfg), *ETCD, "train.py"]).health.enabled


@pytest.mark.parametrize("argv, message", [
    ([], "needs a script"),
    (["--set", "train.steps=3", "train.py"], "only elastic.* fields"),
    (["--standalone", "train.py"], "does not take --standalone"),
    (["--rdzv-backend", "c10d", "train.py"], "--rdzv-backend c10d is not supported"),
    (["--no-such-flag", "1", "train.py"], "unknown flag(s) --no-such-flag"),
])
def test_command_lines_it_cannot_run_say_why(argv: list[str], message: str):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        _request(argv)


def test_every_flag_without_a_value_is_known_to_the_torch_free_split():
    no_value = {o for a in get_args_parser()._actions if a.option_strings and a.nargs == 0 for o in a.option_strings}
    assert no_value <= FLAGS_WITHOUT_VALUE


def test_the_split_finds_the_script_after_flags_with_and_without_values():
    run = RunArgs.split(["--config=j.yaml", "--nnodes", "1:2", "--standalone", "--set", "elastic.run_id=x",
                         "--heartbeat-timeout=3", "-m", "pkg.mod", "--set", "y"])
    assert run.config == "j.yaml" and run.overrides == ["elastic.run_id=x"]
    assert run.flags == ["--nnodes", "1:2", "--standalone", "--heartbeat-timeout=3"]
    assert (run.module, run.target, run.target_args) == (True, "pkg.mod", ["--set", "y"])
    assert run.flag("--nnodes") == "1:2" and run.flag("--heartbeat-timeout") == "3"
    assert run.worker_args() == ["-u", "-m", "pkg.mod", "--set", "y"]
