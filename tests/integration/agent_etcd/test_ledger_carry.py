"""The time ledger survives a full restart: the agent at group rank 0 keeps it in `<checkpoint.url>/ledger.json`,
and a job started again on an empty etcd continues it (elastictrain/agent/ledger_file.py). A real etcd and a
file:// checkpoint root, the publishers of the agents alone (no processes): about a second."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, replace

import pytest

from elastictrain.agent.jobstate import collect
from elastictrain.agent.ledger import CARRIED_EVENT, FAULT_COST_EVENT
from elastictrain.agent.ledger_file import LEDGER_FILE
from elastictrain.agent.status import EtcdStatusPublisher, JobRecord, job_key, read_events
from elastictrain.cli.status import render
from elastictrain.cli.target import JobConnection
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.settings import EtcdSettings


@pytest.fixture
def conn(etcd, run_id):
    settings = EtcdSettings.from_conf(etcd.endpoint, run_id, {})
    client = EtcdClient(settings)
    client.connect()
    yield JobConnection(client, settings)
    client.delete_prefix(settings.run_prefix)
    client.close()


def _job(conn: JobConnection, url: str, started: float) -> JobRecord:
    """The job record an agent writes at start (`publish_job` would take this test process's start time: one
    process plays both lives here, so the record is written as each life's agents would)."""
    job = JobRecord(run_id=conn.settings.run_id, config="", checkpoint_url=url, fingerprint={"model": "m1"},
                    max_restarts=10, min_nodes=1, max_nodes=2, nproc_per_node=1, steps=100, started=started)
    conn.client.put(job_key(conn.prefix), json.dumps(asdict(job)).encode())
    return job


def _events(pub: EtcdStatusPublisher, *events: tuple[str, dict]) -> None:
    for kind, fields in events:
        pub.on_event(kind, fields)
        time.sleep(0.01)


def test_a_job_started_again_on_an_empty_etcd_continues_its_ledger_from_the_checkpoint_root(conn, tmp_path):
    root = tmp_path / "ckpt"
    began = time.time() - 3
    _job(conn, str(root), began)
    # first life: a worker kill recovered from step 4; the rank-0 agent writes the file at its rounds and its end
    a = EtcdStatusPublisher(conn.client, conn.prefix, "node-a")
    _events(a, ("join", {"group_rank": 0}), ("checkpoint_saved", {"step": 4, "blocking_s": 0.1}),
            ("failure", {"cause": "rank 1: Signal 9 (SIGKILL)"}), ("restart", {"reason": "failure"}),
            ("join", {"group_rank": 0}), ("checkpoint_loaded", {"step": 4}))
    time.sleep(0.5)  # training
    _events(a, ("checkpoint_saved", {"step": 8, "blocking_s": 0.1}))
    a.flush()
    a.close()
    kept = json.loads((root / LEDGER_FILE).read_text())
    first = collect(conn, events=0, checkpoint=False).ledger
    assert kept["run_id"] == conn.settings.run_id and kept["started"] == pytest.approx(began)
    assert [f["kind"] for f in kept["faults"]] == ["worker failure"] and kept["step"] == 8
    assert sum(kept["buckets"].values()) == pytest.approx(kept["wall_s"], rel=0.02)
    assert kept["wall_s"] == pytest.approx(first["wall_s"], abs=1.0)

    # the whole job goes down; it is started again later on an empty etcd (the embedded one, or a wiped one)
    conn.client.delete_prefix(conn.prefix)
    time.sleep(0.5)
    relaunched = time.time()
    _job(conn, str(root), relaunched)
    a2 = EtcdStatusPublisher(conn.client, conn.prefix, "node-a2")
    _events(a2, ("join", {"group_rank": 0}), ("checkpoint_loaded", {"step": 8}))
    time.sleep(0.5)
    _events(a2, ("checkpoint_saved", {"step": 12, "blocking_s": 0.1}))
    a2.flush()
    a2.keeper.close()  # its first round: the carry
    _events(a2, ("checkpoint_saved", {"step": 16, "blocking_s": 0.1}))
    a2.flush()  # the group got further: the full restart's cost is final and reported

    view = collect(conn, events=0, checkpoint=False)
    led = view.ledger
    assert led["started"] == pytest.approx(began), "the job began in its first life"
    assert led["wall_s"] == pytest.approx(time.time() - began, abs=1.5)
    assert sum(led["buckets"].values()) == pytest.approx(led["wall_s"], rel=0.02)
    assert [f["kind"] for f in led["faults"]] == ["worker failure", "full restart"]
    restart = led["faults"][1]
    assert restart["restart_s"] >= relaunched - kept["until"] >= 0.5, "the time the job was down is lost to it"
    assert restart["resumed_step"] == 8 and restart["recomputed_steps"] == 0
    assert kept["buckets"]["training"] >= 0.3 and led["buckets"]["training"] >= kept["buckets"]["training"] + 0.3
    assert led["ettr"] == pytest.approx(led["buckets"]["training"] / led["wall_s"], abs=1e-3)
    assert led["carried"]["faults"] == 1 and led["carried"]["started"] == pytest.approx(began)
    assert "ETTR:" in render(view) and "full restart: lost" in render(view)
    costs = [e for e in read_events(conn.client, conn.prefix) if e.kind == FAULT_COST_EVENT]
    assert [c.fields["kind"] for c in costs] == ["full restart"], \
        "the carried fault was reported in its own etcd; the full restart is reported once, here"

    # a node that becomes group rank 0 later in the same etcd carries nothing again
    b2 = EtcdStatusPublisher(conn.client, conn.prefix, "node-b2")
    assert b2.keeper.run_once()
    assert [e.kind for e in read_events(conn.client, conn.prefix)].count(CARRIED_EVENT) == 1
    again = collect(conn, events=0, checkpoint=False).ledger
    assert [f["kind"] for f in again["faults"]] == ["worker failure", "full restart"]
    assert json.loads((root / LEDGER_FILE).read_text())["started"] == pytest.approx(began)
    a2.close()


def test_storage_that_fails_or_a_torn_file_is_a_warning_and_training_goes_on(conn, tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    job = _job(conn, str(blocker / "ckpt"), time.time() - 5)
    pub = EtcdStatusPublisher(conn.client, conn.prefix, "node-a")
    _events(pub, ("join", {"group_rank": 0}), ("checkpoint_saved", {"step": 4, "blocking_s": 0.1}))
    with caplog.at_level(logging.DEBUG, logger="elastictrain.agent.ledger_file"):
        assert not pub.keeper.run_once() and not pub.keeper.run_once()
        pub.flush()  # and the publisher's own round neither raises nor waits for it
        pub.keeper.close()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and LEDGER_FILE in warned[0].getMessage(), "once, then quiet until it works"

    root = tmp_path / "ckpt"
    root.mkdir()
    (root / LEDGER_FILE).write_text('{"run_id": "torn')
    conn.client.put(job_key(conn.prefix), json.dumps(asdict(replace(job, checkpoint_url=str(root)))).encode())
    keeper = EtcdStatusPublisher(conn.client, conn.prefix, "node-a2").keeper
    assert keeper.run_once(), "a torn file is not carried, and is replaced"
    assert json.loads((root / LEDGER_FILE).read_text())["run_id"] == conn.settings.run_id
    assert not [e for e in read_events(conn.client, conn.prefix) if e.kind == CARRIED_EVENT]
    assert sorted(p.name for p in root.iterdir()) == [LEDGER_FILE], "no temporary file left behind"
    pub.close()
