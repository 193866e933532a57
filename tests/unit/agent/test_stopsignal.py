"""The agent's stop signals pass best-effort `except Exception` handlers (elastictrain/agent/stopsignal.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from torch.distributed.elastic.multiprocessing import api as mp_api
from torch.distributed.elastic.multiprocessing.api import SignalException

from elastictrain.agent import stopsignal


@pytest.fixture
def torch_handler():
    """torch's handler installed for SIGTERM, as its process context does at every worker start."""
    old = signal.signal(signal.SIGTERM, mp_api._terminate_process_handler)
    yield
    signal.signal(signal.SIGTERM, old)


def _best_effort_call_hit_by_sigterm() -> None:
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2)  # the handler runs here
    except Exception:  # noqa: BLE001 - what the agent's etcd and listener calls do with their errors
        pass


def test_a_sigterm_in_a_best_effort_handler_reaches_the_caller_as_torchs_signal_exception(torch_handler):
    stopsignal.install()
    try:
        with pytest.raises(SignalException) as got:
            with stopsignal.as_torch_signal():
                _best_effort_call_hit_by_sigterm()
                pytest.fail("the signal was swallowed")
        assert got.value.sigval == signal.SIGTERM
    finally:
        stopsignal.uninstall()
    assert signal.getsignal(signal.SIGTERM) is mp_api._terminate_process_handler, "torch's handler is put back"


def test_only_torchs_handler_is_replaced(torch_handler):
    def own(signum, frame):
        pass

    signal.signal(signal.SIGTERM, own)  # a handler someone else installed is theirs
    stopsignal.install()
    assert signal.getsignal(signal.SIGTERM) is own
