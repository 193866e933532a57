"""Lease-aware pruning of torch's rendezvous state and the change-driven wait (fakes, no etcd)."""

from __future__ import annotations

import pickle
import signal
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousState,
)

from elastictrain.rendezvous.state import LeaseAwareStateHolder, WatchingOpExecutor, may_complete_early, node_id

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


def _executor(rejoin_wait: float = 0.0) -> WatchingOpExecutor:
    holder = LeaseAwareStateHolder(FakeBackend(_RendezvousState()), SETTINGS, FakeLiveness(set()))
    return WatchingOpExecutor(A, holder, SETTINGS, FakeLiveness(set()), rejoin_wait)


def test_waiting_wakes_at_the_last_call_deadline_but_never_sleeps_past_a_second() -> None:
    state = _RendezvousState()
    ctx = _RendezvousContext(A, state, SETTINGS)
    executor = _executor()
    assert executor._sync_wait(ctx) == 1.0
    state.deadline = datetime.now(timezone.utc) + timedelta(seconds=0.3)
    assert 0.2 < executor._sync_wait(ctx) <= 0.31
    state.deadline = datetime.now(timezone.utc) - timedelta(seconds=5)
    assert executor._sync_wait(ctx) <= 0.01 + 1e-9


def test_waiting_also_wakes_when_the_rejoin_wait_ends() -> None:
    state = _RendezvousState()
    last_call = SETTINGS.timeout.last_call.total_seconds()  # torch's default: 30 s
    state.deadline = datetime.now(timezone.utc) + timedelta(seconds=last_call)
    ctx = _RendezvousContext(A, state, SETTINGS)
    assert 0.2 < _executor(rejoin_wait=0.3)._sync_wait(ctx) <= 0.31


def _forming_round(*participants: _NodeDesc, round_: int = 1, last_call_elapsed: float = 0.1) -> _RendezvousState:
    state = _RendezvousState()
    state.round = round_
    for node in participants:
        state.participants[node] = 0
    state.deadline = datetime.now(timezone.utc) + SETTINGS.timeout.last_call - timedelta(seconds=last_call_elapsed)
    return state


def _may(state: _RendezvousState, alive: set[_NodeDesc], rejoin_wait: float = 0.0, node: _NodeDesc = A) -> bool:
    ctx = _RendezvousContext(node, state, SETTINGS)
    return may_complete_early(ctx, {node_id(n) for n in alive}, rejoin_wait, datetime.now(timezone.utc))


def test_a_reforming_round_completes_once_every_live_node_joined() -> None:
    # node loss: C's lease expired, A and B re-formed; nobody else is alive, so nobody else is waited for
    assert _may(_forming_round(A, B), alive={A, B})


def test_a_live_node_that_has_not_joined_yet_is_waited_for() -> None:
    assert not _may(_forming_round(A, B), alive={A, B, C})


def test_the_first_formation_waits_out_the_last_call_for_nodes_still_starting() -> None:
    assert not _may(_forming_round(A, round_=0), alive={A})


def test_the_rejoin_wait_keeps_part_of_the_last_call_for_a_lost_node() -> None:
    assert not _may(_forming_round(A, last_call_elapsed=1.0), alive={A}, rejoin_wait=3.0)
    assert _may(_forming_round(A, last_call_elapsed=3.5), alive={A}, rejoin_wait=3.0)


def test_only_a_participant_completes_and_only_within_min_and_max_nodes() -> None:
    assert not _may(_forming_round(A, B), alive={A, B}, node=C)
    state = _forming_round(A)
    state.deadline = None  # fewer than min_nodes: no last call started
    assert not _may(state, alive={A})
    full = _forming_round(A, B)
    full.complete = True
    assert not _may(full, alive={A, B})


class CachedLiveness:
    """A watch cache that missed a node record put a moment ago; etcd itself knows it."""

    def __init__(self, cached: set[_NodeDesc], in_etcd: set[_NodeDesc]) -> None:
        self._alive = {node_id(n) for n in cached}
        self._etcd = {node_id(n) for n in in_etcd}
        self.reads = 0

    def alive_nodes(self) -> set[str]:
        return set(self._alive)

    def confirm_alive(self, node_ids: set[str]) -> set[str]:
        self.reads += 1
        self._alive = set(self._etcd)
        return node_ids & self._alive


def _decide(liveness: CachedLiveness):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action

    holder = LeaseAwareStateHolder(FakeBackend(_RendezvousState()), SETTINGS, FakeLiveness(set()))
    executor = WatchingOpExecutor(A, holder, SETTINGS, liveness)
    ctx = _RendezvousContext(A, _forming_round(A, B), SETTINGS)
    return executor._early_completion(ctx, _Action.SYNC), _Action


def test_early_completion_is_decided_on_a_fresh_read_not_the_watch_cache() -> None:
    late = CachedLiveness(cached={A, B}, in_etcd={A, B, C})  # C registered, the watch has not told us yet
    action, actions = _decide(late)
    assert action == actions.SYNC and late.reads == 1
    everyone = CachedLiveness(cached={A, B}, in_etcd={A, B})
    action, actions = _decide(everyone)
    assert action == actions.MARK_RENDEZVOUS_COMPLETE


def test_a_sigterm_while_the_state_watch_is_set_up_stops_the_agent_instead_of_falling_back_to_polling() -> None:
    """torch turns SIGTERM into a SignalException raised wherever the agent's main thread is. Seen in CI: it came
    while the watch was retried during an etcd outage, the watch's fallback swallowed it as an etcd error, and the
    agent trained on, ignoring the stop, until it was killed 60 s later."""
    class SignalledClient:
        def watch_prefix(self, *args, **kwargs):
            raise SignalException("Process 1 got signal: 15", signal.SIGTERM)

    holder = LeaseAwareStateHolder(FakeBackend(_complete_round(A)), SETTINGS, FakeLiveness(set()))
    with pytest.raises(SignalException):
        holder.watch(SignalledClient())  # type: ignore[arg-type]

    class DownClient:
        def watch_prefix(self, *args, **kwargs):
            raise OSError("etcd unavailable")

    holder.watch(DownClient())  # type: ignore[arg-type]  # an etcd error still falls back to polling
