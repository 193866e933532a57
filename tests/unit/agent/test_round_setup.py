"""A rendezvous round whose set-up never arrives (its first node died right after it formed) is left for a new
round instead of crashing the agent (no etcd needed: a stand-in handler and torch's in-memory stores)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed import DistStoreError, HashStore
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousInfo
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from elastictrain.agent.agent import ElasticAgent


class Rounds:
    """Round 1: this node is group rank 1 of 2 and group rank 0 never publishes the ranks; then rounds of 1 node."""

    def __init__(self, dead_rounds: int):
        self.calls, self.dead_rounds = 0, dead_rounds

    def next_rendezvous(self) -> RendezvousInfo:
        self.calls += 1
        store = HashStore()
        if self.calls <= self.dead_rounds:
            store.set_timeout(timedelta(seconds=0.2))
            return RendezvousInfo(store, 1, 2, RendezvousStoreInfo("127.0.0.1", 0))
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo("127.0.0.1", 0))

    def get_run_id(self) -> str:
        return "round-setup"

    def get_backend(self) -> str:
        return "stand-in"


def _agent(handler, tmp_path) -> ElasticAgent:
    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=handler, entrypoint="python", args=())
    return ElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path)), warm_spares=False)


def test_a_round_whose_ranks_never_come_is_left_for_a_new_one(tmp_path, caplog):
    handler = Rounds(dead_rounds=1)
    agent = _agent(handler, tmp_path)
    agent._rendezvous(agent._worker_group)
    assert handler.calls == 2
    assert agent._worker_group.group_world_size == 1 and agent._worker_group.workers[0].global_rank == 0
    assert "joining a new round" in caplog.text


def test_it_gives_up_after_three_rounds_with_torchs_error(tmp_path):
    handler = Rounds(dead_rounds=5)
    agent = _agent(handler, tmp_path)
    with pytest.raises(DistStoreError):
        agent._rendezvous(agent._worker_group)
    assert handler.calls == 3
