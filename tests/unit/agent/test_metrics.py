"""The agent's Prometheus endpoint, scraped over loopback HTTP (elastictrain/agent/metrics.py)."""

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastictrain.agent.metrics import AgentCollector, MetricsServer
from elastictrain.agent.status import NodeStatus, WorkerStatus


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_scrape_reports_step_step_time_restarts_heartbeats_and_checkpoint_age(monkeypatch):
    st = NodeStatus(node="n1", host="h", agent_pid=1, state="running", step=42, step_time_s=0.25, restarts_used=1,
                    max_restarts=3, workers=[WorkerStatus(0, 11, 42, "train", 0.4), WorkerStatus(1, 12, 41, "train",
                                                                                                 None)],
                    stragglers_replaced={"restart": 2})
    created = time.time() - 30
    monkeypatch.setattr("elastictrain.agent.metrics.latest_checkpoint", lambda url: (40, created, url + "/s40"))
    server = MetricsServer(AgentCollector(lambda: st, "file:///ckpt"), 0, "127.0.0.1")
    try:
        got = _scrape(server.port)
    finally:
        server.close()
    n = (("node", "n1"),)
    assert got[("elastictrain_step", n)] == 42
    assert got[("elastictrain_step_time_seconds", n)] == 0.25
    assert (got[("elastictrain_restarts_used", n)], got[("elastictrain_restarts_max", n)]) == (1, 3)
    assert got[("elastictrain_worker_heartbeat_age_seconds", (("local_rank", "0"), ("node", "n1")))] == 0.4
    assert ("elastictrain_worker_heartbeat_age_seconds", (("local_rank", "1"), ("node", "n1"))) not in got
    assert got[("elastictrain_node_up", (("node", "n1"), ("state", "running")))] == 1
    assert got[("elastictrain_checkpoint_step", n)] == 40
    assert got[("elastictrain_stragglers_replaced_total", (("action", "restart"), ("node", "n1")))] == 2
    assert 29 <= got[("elastictrain_checkpoint_age_seconds", n)] < 60


def test_scrape_answers_without_a_step_or_checkpoint_yet():
    st = NodeStatus(node="n1", host="h", agent_pid=1, state="starting")
    server = MetricsServer(AgentCollector(lambda: st, None), 0, "127.0.0.1")
    try:
        got = _scrape(server.port)
    finally:
        server.close()
    assert ("elastictrain_step", (("node", "n1"),)) not in got
    assert got[("elastictrain_node_up", (("node", "n1"), ("state", "starting")))] == 1


def test_scrape_reports_the_time_ledger_buckets_ettr_and_fault_costs():
    from elastictrain.agent.ledger import compute

    log = [{"time": t, "node": n, "kind": k, "fields": f} for t, n, k, f in (
        (2, "a", "join", {}), (10, "b", "failure", {"cause": "x"}), (12, "a", "join", {}),
        (13, "a", "checkpoint_loaded", {"step": 0}), (20, "a", "succeeded", {}))]
    led = compute(log, started=0.0, now=30.0, final_step=10)
    st = NodeStatus(node="n1", host="h", agent_pid=1, state="running")
    server = MetricsServer(AgentCollector(lambda: st, None, ledger=lambda: led), 0, "127.0.0.1")
    try:
        got = _scrape(server.port)
    finally:
        server.close()
    assert got[("elastictrain_wall_seconds", ())] == 20
    assert sum(v for (name, _), v in got.items() if name == "elastictrain_time_seconds") == pytest.approx(20)
    assert got[("elastictrain_time_seconds", (("bucket", "restarting"),))] == 2
    assert got[("elastictrain_ettr", ())] == led.ettr
    assert got[("elastictrain_faults_total", (("kind", "worker failure"),))] == 1
    assert got[("elastictrain_fault_lost_seconds_total", (("kind", "worker failure"),))] == led.faults[0].lost_s
    assert ("elastictrain_recomputed_steps_total", ()) in got
