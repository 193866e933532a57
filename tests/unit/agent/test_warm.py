"""How the warm pool gets torch's worker start (elastictrain/agent/warm.py torch_starts_workers_with)."""

from __future__ import annotations

import inspect
import logging

import pytest
from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from elastictrain.agent.warm import torch_starts_workers_with


def test_torch_still_starts_workers_through_the_module_level_start_processes():
    # What the substitution relies on; when a torch upgrade breaks it, spares would be bypassed silently.
    start_workers = inspect.unwrap(LocalElasticAgent._start_workers)
    assert start_workers.__globals__ is vars(local_elastic_agent)
    assert "start_processes" in start_workers.__code__.co_names


def test_the_start_is_served_within_the_block_and_torchs_is_back_after_it():
    torch_start = local_elastic_agent.start_processes
    calls = []
    with torch_starts_workers_with(lambda **kw: calls.append(kw) or "context"):
        assert local_elastic_agent.start_processes(name="trainer", entrypoint="python") == "context"
    assert calls == [{"name": "trainer", "entrypoint": "python"}]
    assert local_elastic_agent.start_processes is torch_start


def test_torchs_start_is_back_after_an_error_too():
    torch_start = local_elastic_agent.start_processes
    with pytest.raises(RuntimeError, match="rendezvous closed"):
        with torch_starts_workers_with(lambda **kw: None):
            raise RuntimeError("rendezvous closed")
    assert local_elastic_agent.start_processes is torch_start


def test_a_start_that_bypassed_the_pool_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="elastictrain.agent.warm"):
        with torch_starts_workers_with(lambda **kw: None):
            pass
    assert "spares and the fast stop of a crashed group are off" in caplog.text


def test_a_worker_started_cold_runs_through_the_spares_module_only_under_python():
    from elastictrain.agent.warm import cold_args

    assert cold_args("/usr/bin/python3.11", ("-u", "train.py", "--x")) == (
        "-u", "-m", "elastictrain.runtime.warmstart", "--run-now", "-u", "train.py", "--x")
    assert cold_args("/opt/bin/trainer", ("--steps", "3")) == ("--steps", "3")  # a binary starts as it is
