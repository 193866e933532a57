"""The operator CLI against a real job: etcd + 2 `elastictrain run` agents training the tiny model.

One job walks through what an operator sees and does: status (JSON, table, probe exit code), metrics, events,
a straggler (rank 1 sleeps before every step: the chaos `slow@` fault) named in status, metrics and events,
`ckpt now`, a killed worker (recovering, then running again from the requested checkpoint, budget charged),
pause/resume, drain of one node, and finally a lost agent (the probe fails).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from elastictrain.agent.jobstate import collect
from elastictrain.cli.target import JobConnection
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.settings import EtcdSettings
from elastictrain.runtime.injected_faults import ENV_CHAOS
from tests.integration.cli.live_job import LiveJob

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0]] = float(value)
    return out


def _wait_view(target: JobConnection, pred, timeout: float, what: str):
    """In-process status reads every 0.1 s: catches states that last only a second or two."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        v = collect(target, events=0, checkpoint=False)
        seen.append(v.state)
        if pred(v):
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; states seen: {sorted(set(seen))}")


def test_operator_cli_follows_and_steers_a_real_two_node_job(etcd, run_id, tmp_path: Path):
    # No periodic checkpoints: the only one is the operator's, and recovery must resume from it.
    job = LiveJob(etcd.endpoint, run_id, tmp_path, steps=100_000, extra=["--heartbeat-timeout=60"],
                  overrides=["checkpoint.every_steps=0"], env={ENV_CHAOS: "slow@ms=400,rank=1"})
    ports = [_free_port(), _free_port()]
    settings = EtcdSettings.from_conf(etcd.endpoint, run_id, {})
    client = EtcdClient(settings)
    client.connect()
    target = JobConnection(client, settings)
    try:
        a = job.start_agent(f"--metrics-port={ports[0]}", "--metrics-addr=127.0.0.1")
        b = job.start_agent(f"--metrics-port={ports[1]}", "--metrics-addr=127.0.0.1")

        # --- running: JSON, table, probe exit code, metrics, events
        st = job.wait_status(lambda s: s["state"] == "running" and len(s["members"]) == 2
                             and all((m["step"] or 0) >= 5 for m in s["members"]), 150, "two nodes training")
        assert st["healthy"] and st["restarts_used"] == 0 and st["max_restarts"] == 3
        assert st["rendezvous"]["participants"] == 2 and st["rendezvous"]["complete"]
        assert sorted(m["group_rank"] for m in st["members"]) == [0, 1]
        assert st["checkpoint_url"] == str(job.ckpt)
        table = job.cli_process("status")  # once through the real entry point
        assert table.returncode == 0, table.stderr
        assert f"run {run_id}: RUNNING (healthy)" in table.stdout and "restarts:   0 of 3 used" in table.stdout
        for m in st["members"]:
            assert m["node"] in table.stdout
        metrics = _scrape(ports[0])
        assert metrics["elastictrain_step"] >= 5 and metrics["elastictrain_restarts_max"] == 3
        assert "elastictrain_worker_heartbeat_age_seconds" in metrics
        events = job.cli("events")
        assert events.returncode == 0 and events.stdout.count(" join ") == 2, events.stdout

        # --- the straggler: rank 1 is 400 ms late before every step; named after 20 such steps. (It was 80 ms:
        # under the 20 % margin once a step of this tiny model took 0.5 s, on a machine 3x slower than usual.)
        st = job.wait_status(lambda s: any("1" in m["stragglers"] for m in s["members"]), 90, "a straggler named")
        named = next(m["stragglers"]["1"] for m in st["members"] if "1" in m["stragglers"])
        assert 0.2 < named["lateness_s"] < 2.0 and named["score"] > 0.2, named
        assert all(set(m["stragglers"]) <= {"1"} for m in st["members"]), "only the slow rank is named"
        assert "straggler:  rank 1: " in job.cli("status").stdout
        assert any(_scrape(p).get("elastictrain_straggler_lateness_seconds", 0) > 0.2 for p in ports)
        assert " straggler " in job.cli("events").stdout

        # --- ckpt now: saved once, at one step, and shown by status
        r = job.cli("ckpt", "now", "--yes", "--reason", "before maintenance")
        assert r.returncode == 0, r.stderr
        st = job.wait_status(lambda s: s["checkpoint"] is not None, 60, "the requested checkpoint")
        saved = st["checkpoint"]["step"]
        assert st["checkpoint"]["url"].endswith(f"{saved:08d}")
        assert job.logs(100_000).count("on operator request") == 1

        # --- a killed worker: recovering, then running again from the requested checkpoint; budget charged
        victim = job.worker_pids(b)[0]
        os.kill(victim, signal.SIGKILL)
        rec = _wait_view(target, lambda v: v.state == "recovering", 30, "recovering after a killed worker")
        assert rec.restarts_used <= 1
        assert rec.healthy  # recovering briefly is not a fault
        st = job.wait_status(lambda s: s["state"] == "running" and s["restarts_used"] == 1
                             and all((m["step"] or 0) > saved for m in s["members"]), 150, "recovered job")
        events = job.cli("events", "--since", "5m").stdout
        assert f"Signal 9 (SIGKILL) received by PID {victim}" in events and " restart " in events
        assert f"resumed from {job.ckpt}" in job.logs(100_000) or f"step-{saved:08d}" in job.logs(100_000)

        # --- pause in place, then resume
        assert job.cli("pause", "--yes").returncode == 0
        st = job.wait_status(lambda s: s["state"] == "paused", 60, "paused")
        step = st["step"]
        time.sleep(2)
        assert job.status()["step"] == step
        table = job.cli("status").stdout
        assert "PAUSED (healthy)" in table and "paused" in table.split("NODE", 1)[1]
        assert job.cli("ckpt", "now", "--yes").returncode == 0  # saved while paused, at the paused step
        job.wait_status(lambda s: (s["checkpoint"] or {}).get("step") == step, 60, "a checkpoint while paused")
        assert job.cli("resume", "--yes").returncode == 0
        job.wait_status(lambda s: s["state"] == "running" and s["step"] > step + 2, 60, "resumed")

        # --- drain node b: it leaves, a goes on alone, free of charge
        node_b = next(m["node"] for m in job.status()["members"] if m["group_rank"] == 1)
        assert job.cli("drain", node_b, "--yes").returncode == 0
        assert b.wait(timeout=60) == 0
        st = job.wait_status(lambda s: s["state"] == "running" and s["rendezvous"]["participants"] == 1
                             and any(m["state"] == "running" and (m["step"] or 0) > 0 for m in s["members"]),
                             90, "the survivor training alone")
        assert {m["node"]: m["state"] for m in st["members"]}[node_b] == "left"
        assert st["restarts_used"] == 1 and st["healthy"]
        kinds = [json.loads(line)["kind"] for line in job.cli("events", "--json").stdout.splitlines()]
        assert kinds.count("operator") == 5 and "drain" in kinds  # ckpt, pause, ckpt, resume, drain

        # --- the last agent dies without a word: the probe fails once its status goes stale
        os.killpg(a.pid, signal.SIGKILL)
        a.wait(timeout=10)
        time.sleep(4)
        probe = job.cli_process("status", "--stale-after", "3")
        assert probe.returncode == 1, probe.stdout
        assert "UNHEALTHY" in probe.stdout and "has not reported" in probe.stdout + probe.stderr or \
            "no agent of this job reports" in probe.stdout
    finally:
        job.stop()
        client.delete_prefix(settings.run_prefix)
        client.close()


def test_the_rank_0_node_reports_each_fault_cost_once_and_a_rejoining_node_keeps_the_job_start(etcd, run_id):
    """The publisher alone against a real etcd (no processes): what the chaos test relies on, in a second."""
    from elastictrain.agent.status import EtcdStatusPublisher, JobRecord, publish_job, read_events, read_job

    settings = EtcdSettings.from_conf(etcd.endpoint, run_id, {})
    client = EtcdClient(settings)
    client.connect()
    try:
        job = JobRecord(run_id=run_id, config="", checkpoint_url=None, fingerprint={"model": "x"}, max_restarts=3,
                        min_nodes=1, max_nodes=2, nproc_per_node=1, steps=20, started=time.time() + 100)
        publish_job(client, settings.run_prefix, job)
        first = read_job(client, settings.run_prefix).started
        assert first <= time.time(), "the job began when this (agent) process started"
        publish_job(client, settings.run_prefix, job)  # a re-joining node: its own start is later
        assert read_job(client, settings.run_prefix).started == first
        pub = EtcdStatusPublisher(client, settings.run_prefix, "node-a")
        for kind, fields in (("join", {"group_rank": 0}), ("checkpoint_saved", {"step": 4, "blocking_s": 0.1}),
                             ("failure", {"cause": "rank 1: Signal 9 (SIGKILL)"}), ("restart", {"reason": "failure"}),
                             ("join", {"group_rank": 0}), ("checkpoint_loaded", {"step": 4}),
                             ("checkpoint_saved", {"step": 8, "blocking_s": 0.1})):
            pub.on_event(kind, fields)
            time.sleep(0.01)
        pub.flush()
        pub.on_event("checkpoint_saved", {"step": 12, "blocking_s": 0.1})
        pub.flush()
        costs = [e for e in read_events(client, settings.run_prefix) if e.kind == "fault_cost"]
        assert len(costs) == 1, "one event per fault, written once"
        assert costs[0].fields["kind"] == "worker failure" and costs[0].fields["complete"]
        assert costs[0].fields["lost_s"] >= 0 and 0 <= costs[0].fields["ettr"] <= 1
    finally:
        client.delete_prefix(settings.run_prefix)
        client.close()
