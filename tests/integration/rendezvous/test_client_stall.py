"""The etcd client after etcd stalled past a call's deadline (a disk stall, a starved CPU): the next call goes
through as soon as etcd answers again."""

from __future__ import annotations

import os
import signal

import pytest

from elastictrain.rendezvous.client import EtcdUnavailableError


def test_after_a_lone_etcd_stalls_past_a_calls_deadline_the_next_call_goes_through(make_client, etcd_private,
                                                                                  run_id) -> None:
    client = make_client(etcd_private.endpoint, run_id, request_timeout=0.5)
    key = f"/elastictrain/{run_id}/stall"
    client.put(key, b"before")
    os.kill(etcd_private.pid, signal.SIGSTOP)
    try:
        with pytest.raises(EtcdUnavailableError, match="DEADLINE_EXCEEDED"):
            client.get(key, tolerance=0.3)  # runs to its 0.5 s deadline
    finally:
        os.kill(etcd_private.pid, signal.SIGCONT)
    # pyetcd took a timed-out endpoint out of use for a while; with one endpoint there is no other to use, so each call
    # in that while failed at once (a lease keep-alive among them): now it is tried again.
    value = client.get(key, tolerance=0.3)
    assert value is not None and value[0] == b"before"
