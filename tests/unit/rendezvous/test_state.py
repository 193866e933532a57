"""Lease-aware pruning of torch's rendezvous state and the change-driven wait (fakes, no etcd)."""

from __future__ import annotations

import pickle
from datetime import datetime, timedelta, timezone

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousState,
)

from elastictrain.rendezvous.state import LeaseAwareStateHolder, WatchingOpExecutor, node_id

SETTINGS = RendezvousSettings("run", 1, 3, RendezvousTimeout(), timedelta(seconds=5), 3)
A, B, C = (_NodeDesc("host", pid, 0) for pid in (1, 2, 3))


class FakeBackend:
    key = "/elastictrain/run/rdzv"
    name = "fake"

    def __init__(self, state: _RendezvousState) -> None:
        self.data = pickle.dumps(state)

    def get_state(self):
        return self.data, 1

    def set_state(self, state, token=None):
        self.data = state
        return state, 2, True


class FakeLiveness:
    def __init__(self, gone: set[str]) -> None:
        self.gone = gone

    def lost(self, node_ids: set[str]) -> set[str]:
        return node_ids & self.gone


def _complete_round(*nodes: _NodeDesc) -> _RendezvousState:
    state = _RendezvousState()
    now = datetime.now(timezone.utc)
    for rank, node in enumerate(nodes):
        state.participants[node] = rank
        state.last_heartbeats[node] = now
    state.complete = True
    return state


def test_a_node_without_lease_is_dropped_although_its_heartbeat_is_fresh() -> None:
    state = _complete_round(A, B, C)
    state.wait_list.add(_NodeDesc("host", 9, 0))
    holder = LeaseAwareStateHolder(FakeBackend(state), SETTINGS, FakeLiveness({node_id(B), "host_9_0"}))
    holder.sync()
    assert set(holder.state.participants) == {A, C}
    assert holder.state.wait_list == set()
    assert B not in holder.state.last_heartbeats
    assert holder.state.complete  # survivors still hold the round until they leave it


def test_the_last_participant_lost_opens_the_next_round() -> None:
    state = _complete_round(A)
    holder = LeaseAwareStateHolder(FakeBackend(state), SETTINGS, FakeLiveness({node_id(A)}))
    holder.sync()
    assert holder.state.participants == {}
    assert not holder.state.complete and holder.state.round == 1


def test_everyone_alive_leaves_the_state_untouched() -> None:
    holder = LeaseAwareStateHolder(FakeBackend(_complete_round(A, B)), SETTINGS, FakeLiveness(set()))
    holder.sync()
    assert set(holder.state.participants) == {A, B}


def test_a_reported_change_bypasses_the_read_cache() -> None:
    backend = FakeBackend(_complete_round(A, B))
    holder = LeaseAwareStateHolder(backend, SETTINGS, FakeLiveness(set()), cache_duration=60)
    holder.sync()
    backend.data = pickle.dumps(_complete_round(A))
    holder.sync()
    assert set(holder.state.participants) == {A, B}  # served from the cache
    holder.notify()
    holder.sync()
    assert set(holder.state.participants) == {A}


def test_waiting_wakes_at_the_last_call_deadline_but_never_sleeps_past_a_second() -> None:
    state = _RendezvousState()
    ctx = _RendezvousContext(A, state, SETTINGS)
    assert WatchingOpExecutor._sync_wait(ctx) == 1.0
    state.deadline = datetime.now(timezone.utc) + timedelta(seconds=0.3)
    assert 0.2 < WatchingOpExecutor._sync_wait(ctx) <= 0.31
    state.deadline = datetime.now(timezone.utc) - timedelta(seconds=5)
    assert WatchingOpExecutor._sync_wait(ctx) <= 0.01 + 1e-9
