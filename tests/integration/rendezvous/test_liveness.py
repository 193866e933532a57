"""Lease-bound node records: peers see a lost node within about one lease TTL."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from elastictrain.rendezvous.liveness import NodeLiveness


def _wait_for(predicate, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout} s")


def _two_nodes(make_client, endpoint: str, run_id: str, watcher: str, watched: str,
               ttl: int) -> tuple[NodeLiveness, NodeLiveness]:
    """Two started nodes of one job, once the first sees the second."""
    prefix = f"/elastictrain/{run_id}/nodes"
    nodes = tuple(NodeLiveness(make_client(endpoint, run_id), prefix, name, ttl=ttl) for name in (watcher, watched))
    for node in nodes:
        node.start()
    _wait_for(lambda: watched in nodes[0].alive_nodes(), 5)
    return nodes


def test_peers_see_each_other_and_a_clean_stop_at_once(make_client, etcd, run_id) -> None:
    a, b = _two_nodes(make_client, etcd.endpoint, run_id, "a", "b", ttl=2)
    assert a.alive_nodes() == {"a", "b"}
    b.stop()  # revokes the lease
    assert _wait_for(lambda: "b" not in a.alive_nodes(), 5) < 1.0
    assert a.lost({"a", "b"}) == {"b"}
    a.stop()


def test_a_node_that_stops_refreshing_is_lost_after_its_ttl(make_client, etcd, run_id) -> None:
    survivor, victim = _two_nodes(make_client, etcd.endpoint, run_id, "survivor", "victim", ttl=2)
    # Simulate SIGKILL: the keep-alive thread stops, nobody revokes the lease.
    victim._stop.set()
    start = time.monotonic()
    _wait_for(lambda: "victim" not in survivor.alive_nodes(), 10)
    elapsed = time.monotonic() - start
    assert 1.0 < elapsed < 4.5, elapsed  # ttl 2 s (+ the keep-alive period it had left)
    assert survivor.lost({"victim", "survivor"}) == {"victim"}
    survivor.stop()


def test_a_cache_miss_is_confirmed_against_etcd_before_declaring_a_node_lost(make_client, etcd, run_id) -> None:
    prefix = f"/elastictrain/{run_id}/nodes"
    a = NodeLiveness(make_client(etcd.endpoint, run_id), prefix, "a", ttl=5)
    a.start()
    # A record the watch has not delivered yet must not count as lost.
    make_client(etcd.endpoint, run_id).put(f"{prefix}/fresh", b"{}")
    with a._alive_lock:
        a._alive.discard("fresh")
    assert a.lost({"fresh"}) == set()
    assert a.lost({"never-registered"}) == {"never-registered"}
    a.stop()


def test_a_stall_of_etcd_shorter_than_the_ttl_keeps_the_lease_and_is_reported(make_client, etcd_private, run_id,
                                                                              caplog) -> None:
    watcher, node = _two_nodes(make_client, etcd_private.endpoint, run_id, "watcher", "slow-etcd", ttl=5)
    with caplog.at_level(logging.WARNING, logger="elastictrain.rendezvous.liveness"):
        os.kill(etcd_private.pid, signal.SIGSTOP)  # etcd answers nothing for 2.6 s (a disk stall, a starved CPU)
        try:
            time.sleep(2.6)
        finally:
            os.kill(etcd_private.pid, signal.SIGCONT)
        _wait_for(lambda: "renewed" in caplog.text, 5)
        time.sleep(1.0)
    assert "lease of node slow-etcd renewed" in caplog.text, caplog.text
    assert watcher.lost({"slow-etcd"}) == set(), "a stall shorter than the TTL must not cost the lease"
    assert "expired" not in caplog.text, caplog.text
    node.stop()
    watcher.stop()


_NODE = """
import sys, time
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.liveness import NodeLiveness
from elastictrain.rendezvous.settings import EtcdSettings
endpoint, run_id, name = sys.argv[1:4]
client = EtcdClient(EtcdSettings.from_conf(endpoint, run_id, {}))
client.connect()
NodeLiveness(client, f"/elastictrain/{run_id}/nodes", name, ttl=10, presence_host="127.0.0.1").start()
print("up", flush=True)
time.sleep(600)
"""


def test_a_killed_agent_is_lost_at_once_through_the_presence_link(make_client, etcd, run_id) -> None:
    """A SIGKILLed agent's lease is revoked by a peer that saw its presence link end: lost in well under the TTL
    (10 s here). A frozen one (SIGSTOP: its sockets stay open) keeps its lease."""
    survivor = NodeLiveness(make_client(etcd.endpoint, run_id), f"/elastictrain/{run_id}/nodes", "a", ttl=10,
                            presence_host="127.0.0.1")
    survivor.start()
    procs = [subprocess.Popen([sys.executable, "-c", _NODE, etcd.endpoint, run_id, name], stdout=subprocess.PIPE,
                              text=True) for name in ("b", "c")]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "up"
        _wait_for(lambda: survivor.watched() == {"b", "c"}, 10)
        os.kill(procs[1].pid, signal.SIGSTOP)  # c frozen
        procs[0].kill()  # b dead
        assert _wait_for(lambda: "b" not in survivor.alive_nodes(), 5) < 1.5
        assert survivor.lost({"a", "b", "c"}) == {"b"}
        time.sleep(2)
        assert survivor.lost({"a", "c"}) == set()  # frozen, lease still valid: for the lease to decide
    finally:
        for proc in procs:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
        survivor.stop()
