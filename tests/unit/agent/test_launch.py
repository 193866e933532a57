"""Command-line parsing of elastictrain/agent/launch.py: torchrun's flags carry over, ours map to HealthConfig."""

import sys

from elastictrain.agent.health import HealthConfig
from elastictrain.agent.launch import DEFAULT_MONITOR_INTERVAL_S, parse_args


def test_torchrun_flags_carry_over():
    req = parse_args(["--nnodes", "2:4", "--nproc-per-node", "3", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", "host:1234", "--rdzv-id", "job7", "--max-restarts", "5",
                      "train.py", "--lr", "1"])
    c = req.config
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node) == (2, 4, 3)
    assert (c.rdzv_backend, c.rdzv_endpoint, c.run_id, c.max_restarts) == ("c10d", "host:1234", "job7", 5)
    assert req.entrypoint == sys.executable
    assert req.args == ["-u", "train.py", "--lr", "1"]
    assert c.monitor_interval == DEFAULT_MONITOR_INTERVAL_S
    assert req.health == HealthConfig(expect_beats=False)  # a user script may not use our heartbeats
    assert req.event_log is None


def test_standalone_gets_a_local_c10d_rendezvous():
    req = parse_args(["--standalone", "--nproc-per-node", "2", "train.py"])
    assert req.config.rdzv_backend == "c10d" and req.config.rdzv_endpoint == "localhost:0"
    assert req.config.run_id


def test_heartbeat_flags_map_to_health_config():
    req = parse_args(["--standalone", "--heartbeat-timeout", "3", "--heartbeat-step-multiplier", "8",
                      "--heartbeat-startup-timeout", "60", "--heartbeat-save-timeout", "1200",
                      "--monitor-interval", "0.2", "--event-log", "/tmp/ev.jsonl", "train.py"])
    h = req.health
    assert h.enabled and h.hang_floor_s == 3 and h.step_time_multiplier == 8
    assert h.startup_timeout_s == 60 and h.save_timeout_s == 1200
    assert req.config.monitor_interval == 0.2 and req.event_log == "/tmp/ev.jsonl"


def test_heartbeat_timeout_zero_turns_hang_detection_off():
    assert not parse_args(["--standalone", "--heartbeat-timeout", "0", "train.py"]).health.enabled


def test_no_log_folder_is_left_in_the_temp_directory(tmp_path, monkeypatch):
    """torch's logs specs make a torchelastic_* folder when a command line is parsed and leave it for good; ours make
    the error files' folder at the first use, in the agent's scratch folder, and remove it at close."""
    import os
    import tempfile

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from elastictrain.agent.logs_specs import ScratchLogsSpecs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    specs = parse_args(["--standalone", "train.py"]).config.logs_specs
    assert isinstance(specs, ScratchLogsSpecs) and list(tmp_path.iterdir()) == []
    dest = specs.reify({0: {"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "0"}})
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith(f"elastictrain-logs-{os.getpid()}-") and dest.error_files[0].startswith(str(folder))
    specs.reify({0: {"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "1"}})  # a restart: the same folder
    assert list(tmp_path.iterdir()) == [folder]
    specs.close()
    assert list(tmp_path.iterdir()) == []
    # The user's folder, or their workers' output redirected into torch's: torch's specs, kept as torch keeps them.
    kept = parse_args(["--standalone", "--log-dir", str(tmp_path / "mine"), "train.py"]).config.logs_specs
    assert type(kept) is DefaultLogsSpecs and kept.root_log_dir == str(tmp_path / "mine")
    assert type(parse_args(["--standalone", "--redirects", "3", "train.py"]).config.logs_specs) is DefaultLogsSpecs
