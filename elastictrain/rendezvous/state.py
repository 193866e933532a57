"""How the etcd3 handler syncs torch's rendezvous state: lease-aware pruning and change-driven waits.

torch's `_BackendRendezvousStateHolder` judges liveness by heartbeat timestamps in the state, and its
op executor polls the backend once a second while it waits. Here:

* `LeaseAwareStateHolder` also drops nodes whose etcd lease expired, and serves reads from its cache
  until etcd reports a change (a watch on the state key and on the node records), so the agent's
  10 Hz `num_nodes_waiting` polling costs nothing while nothing changes;
* `WatchingOpExecutor` waits for such a change (or the round's last-call deadline, or 1 s at most)
  instead of sleeping a fixed second, which takes about a second off every round;
* it also ends a re-forming round's last call early once every node alive in etcd has joined
  (`may_complete_early`): torch waits out the whole last call because it cannot know whether more nodes
  are coming; the node records tell us. A lost node that comes back later joins through a scale-up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    _Action,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _remove_participant_epilogue,
    _RendezvousContext,
    _RendezvousJoinOp,
    _RendezvousState,
)

from elastictrain.rendezvous.backend import EtcdV3Backend
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.liveness import NodeLiveness

logger = logging.getLogger(__name__)

# The longest a waiting node goes without reading the state, should a watch event be missed.
_MAX_WAIT_S = 1.0
# A broken watch (etcd restart, failover) is re-established at most this often, each try bounded.
_REWATCH_EVERY_S = 1.0
_REWATCH_TOLERANCE_S = 0.5


def may_complete_early(ctx: _RendezvousContext, alive: set[str], rejoin_wait: float, now: datetime) -> bool:
    """Whether this participant may complete the round before its last-call deadline.

    Only a re-formation (round > 0; the first formation waits the whole last call for nodes still
    starting), only once `min_nodes` joined, only when every node with a live etcd record is a
    participant (a node alive but not yet joined is waited for, up to the deadline), and only once
    `rejoin_wait` seconds of the last call have passed (time for a lost node to come back).
    """
    state, settings = ctx.state, ctx.settings
    if state.complete or state.closed or state.round == 0 or state.deadline is None:
        return False
    if ctx.node not in state.participants or not settings.min_nodes <= len(state.participants) <= settings.max_nodes:
        return False
    last_call_start = state.deadline - settings.timeout.last_call
    if now < last_call_start + timedelta(seconds=rejoin_wait):
        return False
    return alive <= {node_id(n) for n in state.participants}


def node_id(node: _NodeDesc) -> str:
    """The node record name of a rendezvous participant (torch's `addr_pid_localid`)."""
    return repr(node)


class LeaseAwareStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder, which also drops nodes whose etcd lease expired and re-reads on change."""

    def __init__(
        self,
        backend: EtcdV3Backend,
        settings: RendezvousSettings,
        liveness: NodeLiveness,
        cache_duration: int = 1,
    ) -> None:
        super().__init__(backend, settings, cache_duration)
        self._liveness = liveness
        self._etcd_backend = backend
        self._changed = threading.Event()
        self._watch_id: int | None = None
        self._client: EtcdClient | None = None
        self._watch_broken = False
        self._last_watch_attempt = 0.0
        self._vouched: set[str] = set()

    def watch(self, client: EtcdClient) -> None:
        """Start watching the state key; without the watch, waits fall back to 1 s polling."""
        self._client = client
        self._last_watch_attempt = time.monotonic()
        try:
            self._watch_id = client.watch_prefix(self._etcd_backend.key, self._on_watch, _REWATCH_TOLERANCE_S)
            self._watch_broken = False
        except SignalException:  # torch's SIGTERM/SIGINT, raised in whatever the main thread runs: the agent stops
            raise
        except Exception as exc:  # noqa: BLE001 - polling still works
            logger.warning("cannot watch %s (%s); polling until it works", self._etcd_backend.key, exc)
            self._watch_broken = True

    def unwatch(self, client: EtcdClient) -> None:
        """Stop the watch."""
        if self._watch_id is not None:
            client.cancel_watch(self._watch_id)

    def notify(self) -> None:
        """Something changed (e.g. a node record vanished): re-read the state next time."""
        self._changed.set()

    def _on_watch(self, event: Any) -> None:
        # pyetcd reports a broken stream as an exception (or None) through the callback.
        if event is None or isinstance(event, Exception):
            self._watch_broken = True
        self._changed.set()

    def wait_for_change(self, timeout: float) -> None:
        """Block until a change is reported or `timeout` passes."""
        self._changed.wait(max(timeout, 0.0))

    def sync(self) -> bool | None:
        """See base class; the read cache is bypassed once a change was reported."""
        if self._changed.is_set():
            self._changed.clear()
            self._last_sync_time = -1
        if self._watch_broken:
            # Reads bypass the cache until the watch is back, so no change goes unseen meanwhile.
            self._last_sync_time = -1
            if self._client is not None and time.monotonic() - self._last_watch_attempt > _REWATCH_EVERY_S:
                self.watch(self._client)
        return super().sync()

    def _sanitize(self) -> None:
        self._vouch_for_leased()
        super()._sanitize()
        state: _RendezvousState = self._state
        known = set(state.last_heartbeats) | set(state.participants) | state.wait_list | state.redundancy_list
        by_id = {node_id(n): n for n in known}
        lost = self._liveness.lost(set(by_id))
        if not lost:
            return
        participant_removed = False
        for name in lost:
            node = by_id[name]
            logger.info("node %s lost its etcd lease; removing it from rendezvous '%s'", name, self._settings.run_id)
            state.last_heartbeats.pop(node, None)
            if state.participants.pop(node, None) is not None:
                participant_removed = True
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
            self._dead_nodes.append(node)
        if participant_removed:
            _remove_participant_epilogue(state, self._settings)

    def _vouch_for_leased(self) -> None:
        """Keep a node whose torch heartbeat in the state is stale while its etcd lease lives.

        torch's `_sanitize` drops a node whose last heartbeat (a timestamp its agent's timer thread rewrites into the
        state every `keep_alive_interval`, only once the last one is that old) is older than `keep_alive_interval *
        keep_alive_max_attempt`: at the defaults a live node's timestamp is up to 10 s old, so one late or skipped
        beat (an agent starved of CPU, an etcd write over the heartbeat's 0.5 s tolerance) reaches 15 s. A node that
        read the state then saw a running round without that member: if it was the round's only member left (a
        survivor training alone after a node loss), the round looked over, and a node started then formed a round of
        its own beside it, a split (seen once, goodput run). The lease is the liveness signal here; a node whose
        record lives is alive, whatever its timestamp says."""
        state: _RendezvousState = self._state
        expire = datetime.now(timezone.utc) - self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt
        stale = [n for n, beat in state.last_heartbeats.items() if beat < expire]
        if not stale:
            return
        alive = self._liveness.alive_nodes()
        now = datetime.now(timezone.utc)
        for node in stale:
            name = node_id(node)
            if name not in alive:
                continue
            if name not in self._vouched:
                self._vouched.add(name)
                logger.info("node %s's rendezvous heartbeat is %.0f s old, but its etcd lease lives: keeping it",
                            name, (now - state.last_heartbeats[node]).total_seconds())
            state.last_heartbeats[node] = now


class WatchingOpExecutor(_DistributedRendezvousOpExecutor):
    """torch's op executor; only its SYNC step waits for a change instead of sleeping 1 s.

    `run` follows torch 2.13's `_DistributedRendezvousOpExecutor.run` line for line otherwise
    (event recording aside); re-check it when upgrading torch.
    """

    _state_holder: LeaseAwareStateHolder

    def __init__(
        self,
        node: _NodeDesc,
        state_holder: LeaseAwareStateHolder,
        settings: RendezvousSettings,
        liveness: NodeLiveness | None = None,
        rejoin_wait: float = 0.0,
    ) -> None:
        super().__init__(node, state_holder, settings)
        self._liveness = liveness
        self._rejoin_wait = rejoin_wait

    def run(
        self,
        state_handler: Callable[[_RendezvousContext, float], _Action],
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        """See base class."""
        action = None
        while action != _Action.FINISH:
            self._state_holder.sync()
            self._state = self._state_holder.state
            ctx = _RendezvousContext(self._node, self._state, self._settings)
            action = state_handler(ctx, deadline)
            if action in (_Action.SYNC, _Action.KEEP_ALIVE) and isinstance(state_handler, _RendezvousJoinOp):
                action = self._early_completion(ctx, action)

            if action == _Action.FINISH:
                continue
            if action == _Action.ERROR_CLOSED:
                raise RendezvousClosedError
            if action == _Action.ERROR_TIMEOUT:
                raise RendezvousTimeoutError
            if action == _Action.SYNC:
                self._state_holder.wait_for_change(self._sync_wait(ctx))
                continue

            if action == _Action.KEEP_ALIVE:
                self._keep_alive()
            elif action == _Action.ADD_TO_PARTICIPANTS:
                self._add_to_participants()
            elif action == _Action.ADD_TO_WAIT_LIST:
                self._add_to_wait_list()
            elif action == _Action.ADD_TO_REDUNDANCY_LIST:
                self._add_to_redundancy_list()
            elif action == _Action.REMOVE_FROM_PARTICIPANTS:
                self._remove_from_participants()
            elif action == _Action.REMOVE_FROM_WAIT_LIST:
                self._remove_from_wait_list()
            elif action == _Action.REMOVE_FROM_REDUNDANCY_LIST:
                self._remove_from_redundancy_list()
                if update_deadline:
                    deadline = update_deadline(self._settings.timeout.join)
            elif action == _Action.MARK_RENDEZVOUS_COMPLETE:
                self._mark_rendezvous_complete()
            elif action == _Action.MARK_RENDEZVOUS_CLOSED:
                self._mark_rendezvous_closed()
            self._state_holder.mark_dirty()

    def _early_completion(self, ctx: _RendezvousContext, action: _Action) -> _Action:
        if self._liveness is None:
            return action
        now = datetime.now(timezone.utc)
        if not may_complete_early(ctx, self._liveness.alive_nodes(), self._rejoin_wait, now):
            return action
        # Decide on etcd's word, not the watch cache: a node record put a moment ago must be waited for.
        self._liveness.confirm_alive(set())
        if not may_complete_early(ctx, self._liveness.alive_nodes(), self._rejoin_wait, now):
            return action
        logger.info("every live node joined round %d of rendezvous '%s' (%d participant(s)); completing it "
                    "without waiting out the last call", ctx.state.round, self._settings.run_id,
                    len(ctx.state.participants))
        return _Action.MARK_RENDEZVOUS_COMPLETE

    def _sync_wait(self, ctx: _RendezvousContext) -> float:
        # Wake up right at the last-call deadline (or the end of the re-join wait), when this node may
        # complete the round.
        if ctx.state.deadline is not None:
            now = datetime.now(timezone.utc)
            until = (ctx.state.deadline - now).total_seconds()
            rejoin_until = (ctx.state.deadline - ctx.settings.timeout.last_call - now).total_seconds() + \
                self._rejoin_wait
            if self._liveness is not None and rejoin_until > 0:
                until = min(until, rejoin_until)
            return min(_MAX_WAIT_S, max(until, 0.0) + 0.01)
        return _MAX_WAIT_S
