"""LocalTarget's view of a live job (from node records as agents publish them) and what it refuses to inject."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
from dataclasses import asdict

import pytest

from elastictrain.agent.status import JobRecord, NodeStatus, job_key
from elastictrain.chaos.local import LocalOptions, LocalTarget
from elastictrain.chaos.runner import UnsupportedFault
from elastictrain.chaos.schedule import ScheduledFault
from elastictrain.rendezvous.settings import EtcdSettings

SETTINGS = EtcdSettings.from_conf("127.0.0.1:2379", "run1", {})
PREFIX = SETTINGS.run_prefix


class DictClient:
    """The two EtcdClient reads LocalTarget uses, over a dict."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def get_prefix(self, prefix: str, keys_only: bool = False) -> dict[str, bytes]:
        return {k: v for k, v in self.kv.items() if k.startswith(prefix)}

    def get(self, key: str):
        return (self.kv[key], None) if key in self.kv else None

    def node(self, name: str, *, host: str, pid: int, state: str = "running", step: int = 5,
             age_s: float = 0.0) -> None:
        st = NodeStatus(node=name, host=host, agent_pid=pid, state=state, step=step, updated=time.time() - age_s,
                        state_since=time.time() - 60)
        self.kv[f"{PREFIX}/status/nodes/{name}"] = json.dumps(asdict(st)).encode()


@pytest.fixture
def client():
    return DictClient()


def target(client, **options) -> LocalTarget:
    return LocalTarget(client, SETTINGS, LocalOptions(cache_s=0.0, **options))


def test_only_live_nodes_on_this_host_are_targets(client, caplog):
    me = socket.gethostname()
    client.node("here", host=me, pid=os.getpid(), step=7)
    client.node("remote", host="other-host", pid=1, step=9)
    client.node("stale", host=me, pid=os.getpid(), age_s=60)
    client.node("dead-agent", host=me, pid=2**22 + 12345)
    t = target(client)
    with caplog.at_level("WARNING"):
        assert t.nodes() == ["here"]
    assert "remote runs on host other-host" in caplog.text
    assert t.step() == 9 and not t.finished()
    with pytest.raises(UnsupportedFault, match="run `elastictrain chaos` there"):
        t.inject(ScheduledFault("kill-worker"), "remote", random.Random(0))


def test_finished_once_a_node_succeeded_or_every_node_left(client):
    me = socket.gethostname()
    t = target(client)
    assert not t.finished(), "no agent has reported yet: not started, not finished"
    client.node("a", host=me, pid=os.getpid())
    client.node("b", host=me, pid=os.getpid(), state="succeeded")
    assert t.finished()
    client.node("b", host=me, pid=os.getpid(), state="left")
    client.node("a", host=me, pid=os.getpid(), state="left")
    assert t.finished()


@pytest.mark.parametrize("kind,needs", [
    ("partition", "network-namespace"),
    ("restart-etcd", "--etcd-restart-cmd"),
    ("storage-down", "--s3-server-pid"),
    ("storage-stall", "--s3-server-pid"),
    ("corrupt-checkpoint", "--checkpoint-url"),
])
def test_faults_that_need_more_say_what(client, kind, needs):
    with pytest.raises(UnsupportedFault, match=needs):
        target(client).inject(ScheduledFault(kind), None, random.Random(0))


def test_directory_faults_refuse_an_s3_checkpoint_url(client):
    client.kv[job_key(PREFIX)] = json.dumps(asdict(JobRecord(
        run_id="run1", config="", checkpoint_url="s3://bucket/ckpt", fingerprint={}, max_restarts=0, min_nodes=1,
        max_nodes=2, nproc_per_node=1, steps=10, started=0.0))).encode()
    with pytest.raises(UnsupportedFault, match="directory checkpoint URL"):
        target(client).inject(ScheduledFault("storage-readonly"), None, random.Random(0))


def test_a_job_whose_only_node_is_being_relaunched_is_not_finished(client):
    client.node("a", host=socket.gethostname(), pid=os.getpid(), age_s=60)  # killed: its status went stale
    t = target(client)
    assert t.finished(), "every node gone and none coming back: the job is over"
    heal = t._counting_relaunch(lambda: "re-launched")
    assert not t.finished(), "a node is being started again"
    heal()
    assert not t.finished(), "the re-launched agent has not reported yet"


def test_a_pid_that_is_no_agent_is_never_signalled(client):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        client.node("a", host=socket.gethostname(), pid=sleeper.pid)
        with pytest.raises(UnsupportedFault, match="not an agent"):
            target(client).inject(ScheduledFault("kill-node"), "a", random.Random(0))
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
