"""EtcdRendezvousHandler: torch's DynamicRendezvousHandler on etcd v3, plus lease liveness.

Registered through the `torchrun.handlers` entry point (`entry_point.py`), so `torchrun --rdzv-backend etcd3
--rdzv-endpoint HOST:2379 --rdzv-id JOB ...` uses it once elastictrain is installed.

What differs from torch's c10d rendezvous, and why:

* State (`<prefix>/<run_id>/rdzv`) and the agents' store (`.../store/`) live in etcd, so no agent
  hosts anything the others need: any node, the first included, may die.
* Workers do not share an agent's TCPStore (`use_agent_store` is False and
  `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` is set): rank 0 of each round picks a free port and publishes
  MASTER_ADDR/MASTER_PORT through the etcd store; the rank-0 *worker* then hosts the process group's
  TCPStore. That store only lives as long as one round's worker group, which is restarted on any
  failure anyway, and a fresh one is chosen each round, so it never outlives its host and stale keys
  from older rounds cannot leak into a restarted group.
* Liveness: each agent keeps a lease-bound node record (`.../nodes/<node>`); a lost node's record
  vanishes after `lease_ttl` and survivors (a) drop it from the state and (b) report it through
  `num_nodes_waiting`, which makes torch's agent restart its workers and join a new round.
* Rounds are change-driven (`state.py`): waiting nodes wake on a watch instead of polling each second,
  and a re-forming round completes as soon as every node alive in etcd has joined, instead of waiting
  out the last call for nodes known to be dead (`rejoin_wait` seconds of it are kept, default 0).
* With `in_place_rejoin` > 0 (`elastic.in_place` with `elastic.rejoin_wait_s`), a lost node's place is held that
  long for a new node to take over in place, without a new round (`vacancy.py`); only then is the loss reported.
* A short etcd outage is ridden out: periodic calls (monitor loop, heartbeats) skip a beat instead of
  failing, and only an outage longer than `outage_tolerance` raises.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from datetime import datetime, timedelta, timezone
from typing import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
    _NodeDesc,
)

from elastictrain.rendezvous.backend import EtcdV3Backend
from elastictrain.rendezvous.client import EtcdClient, EtcdUnavailableError
from elastictrain.rendezvous.liveness import NodeLiveness
from elastictrain.rendezvous.settings import DEFAULTS, EtcdSettings, conf_flag, conf_seconds
from elastictrain.rendezvous.shrink import PREFIX as IN_PLACE_PREFIX
from elastictrain.rendezvous.shrink import Shrinks, World, round_ranks
from elastictrain.rendezvous.state import LeaseAwareStateHolder, WatchingOpExecutor, node_id
from elastictrain.rendezvous.store import EtcdStore
from elastictrain.rendezvous.vacancy import Vacancies, Vacancy, local_world_size_of

logger = logging.getLogger(__name__)

_DOUBT_S = 5.0
"""How long a member that lost its lease is doubted before it is reported lost when nothing shows that it died (no
pause of this node's workers): time for a starved agent to register again (shrink.py)."""
_GROWN_POLL_S = 0.25
"""How often a shrunk round's agent looks for a node that took a lost node's place back (shrink.py)."""
_OFFER_GRACE_S = 5.0
"""Beyond the lease's TTL: how long a node started into a full running round waits for a lost node's place."""

# How long one periodic call (monitor loop, heartbeat) may retry before skipping a beat. Both run on (or hold the
# lock of) the agent's monitor loop, and a loop held up longer than the agent's MONITOR_STALL_S (2 s) restarts its
# hang timers: at 2 s each, a node cut off from etcd and its peers stalled 4-5 s a tick and never declared its
# stuck workers hung (netns chaos, partition).
_PERIODIC_TOLERANCE_S = 0.5


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """DynamicRendezvousHandler that reports lost nodes, survives etcd blips and owns its etcd resources."""

    def __init__(
        self,
        node: _NodeDesc,
        settings: RendezvousSettings,
        store: EtcdStore,
        state_holder: LeaseAwareStateHolder,
        client: EtcdClient,
        liveness: NodeLiveness,
        rejoin_wait: float = DEFAULTS["rejoin_wait"],
        vacancies: Vacancies | None = None,
        shrinks: Shrinks | None = None,
    ) -> None:
        super().__init__(node, settings, "etcd3", store, state_holder)
        self._op_executor = WatchingOpExecutor(node, state_holder, settings, liveness, rejoin_wait)
        self._client = client
        self._liveness = liveness
        self._round_members: set[str] = set()
        self._outage_since: float | None = None
        self._vacancies = vacancies
        """In-place re-join (vacancy.py): a lost node's place is held for a new node instead of a new round."""
        self._round: tuple[int, dict[str, int]] | None = None
        """The round this node runs in: its number and every member's group rank (node id -> rank)."""
        self._held: dict[str, float] = {}
        """Lost members whose place is held (node id -> monotonic deadline): not reported until claimed or expired."""
        self._claim: Vacancy | None = None
        self.took_over: Vacancy | None = None
        """The lost node's place this node took in place (set by `claim_vacancy`, for the agent), else None."""
        self._shrinks = shrinks
        """A smaller world in place (shrink.py): a lost node nobody replaces is dropped without a new round."""
        self.local_world_size: int | None = None
        """This node's number of workers (set by the agent): the round's ranks when torch's store does not say."""
        self.shrunk: list[tuple[str, World | None]] = []
        """Lost nodes this round shrank around, for the agent: (node, the world this agent recorded or None)."""
        self._shrunk_round = False
        self.workers_paused: Callable[[], bool] | None = None
        """Set by the agent: whether every local worker pauses in place (its collectives failed: a peer died)."""
        self._doubted: dict[str, float] = {}
        """Lost members not yet dropped in place (node id -> monotonic deadline): no evidence yet that they died."""
        self._lost_seen: dict[str, float] = {}
        """Members of the round seen without a lease, by node id: when first seen so (monotonic)."""
        self.members_lost_at: float | None = None
        """When the lost members of the round last reported (a new round) were first seen without a lease
        (monotonic): the agent judges by it whether its workers still made progress since."""
        self.grow_world: World | None = None
        """With `took_over`: the bigger world this node's claim of a shrunk round's open place recorded (shrink.py)."""
        self.grown: list[tuple[str, str]] = []
        """Places of lost nodes taken back in place since the agent last looked: (lost node, the node that took it)."""
        self._grown_seen: set[str] = set()
        self._grown_checked = 0.0
        store.abandoned = self._round_over

    @property
    def use_agent_store(self) -> bool:
        """False: workers must not depend on a store hosted by one agent (see module docstring)."""
        return False

    @property
    def liveness(self) -> NodeLiveness:
        """This node's lease and peer watch."""
        return self._liveness

    @property
    def this_node(self) -> str:
        """This agent's node id."""
        return node_id(self._this_node)

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class; also remembers the round's members, to notice when one is lost. After `claim_vacancy`,
        the lost node's place in the running round instead of a new round."""
        if self._claim is not None:
            return self._take_over(self._claim)
        info = super().next_rendezvous()
        state = self._state_holder.state
        for _ in range(_PRUNED_ROUND_RETRIES):
            why = pruned_after_completion(list(state.participants.values()), self._settings.min_nodes)
            if why is None:
                break
            # A member lost its lease between the round's completion and this node's read of it (seen in the netns
            # chaos run: 2 of a 3:3 job trained as a group of 2 while the third waited for its ranks). torch would
            # hand out the pruned round's world; leave it instead (next_rendezvous exits the round first) and join
            # the next, which the member that lost its lease joins too once it gives up on this one.
            logger.warning("rendezvous round %d lost a member as it completed (%s); joining a new round",
                           state.round, why)
            info = super().next_rendezvous()
            state = self._state_holder.state
        self._round_members = {node_id(n) for n in state.participants}
        self._round = (state.round, {node_id(n): r for n, r in state.participants.items()})
        self._held.clear()
        self.took_over = self.grow_world = None
        self._shrunk_round = False
        self._grown_seen.clear()
        if self._shrinks is not None and info.rank == 0:
            try:  # a new round numbers its ranks afresh: older rounds' shrinks name nobody in it
                self._shrinks.forget_before(state.round)
            except Exception as e:  # noqa: BLE001 - stale records are keyed by their round; nobody reads them
                logger.debug("could not clear old in-place shrinks: %s", e)
        if self._vacancies is not None and info.rank == 0:
            try:  # a new round: earlier take-overs are plain members of it
                self._vacancies.clear_claims()
            except Exception as e:  # noqa: BLE001 - stale claims name lost nodes only; nobody asks for them again
                logger.debug("could not clear old in-place claims: %s", e)
        return info

    def claim_vacancy(self, local_world_size: int, wait_s: float | None = None) -> Vacancy | None:
        """Take a lost node's place in the running round, if one is held for a node of `local_world_size` workers
        (a node started while its peers pause in place), or open since the round shrank around it (a grow in place,
        shrink.py); the next `next_rendezvous` then returns that place.

        Into a running round with no place offered yet, wait up to `wait_s` (default: the lease's TTL + 5 s) for one:
        a node started again at once comes before its old lease expired, or between the expiry and the survivors'
        offer (one monitor tick). A node that scales the job up pays that wait once before it joins as usual."""
        self.local_world_size = local_world_size
        if self._vacancies is None and self._shrinks is None:
            return None

        def claim() -> Vacancy | None:
            # A place the round shrank around first: it costs the survivors one short pause, a held place more.
            found = self._claim_grow(local_world_size)
            if found is None and self._vacancies is not None:
                found = self._vacancies.claim(self.this_node, local_world_size)
            return found

        found = claim()
        if wait_s is None:
            wait_s = self._client.settings.lease_ttl + _OFFER_GRACE_S
        if found is None and wait_s > 0 and self._round_running():
            # Joining the round now would make every survivor restart instead (seen: a node 0.7 s early).
            deadline = time.monotonic() + wait_s
            logger.info("a round is running; waiting up to %.0f s for a lost node's place to be offered", wait_s)
            while found is None and time.monotonic() < deadline:
                time.sleep(0.2)
                if not self._round_running():
                    break  # the others asked for a new round (a lost node they could not keep a place for): join it
                found = claim()
        if found is not None and self.grow_world is None:
            logger.warning("taking over lost node %s's place in round %d in place: group rank %d of %d",
                           found.lost, found.round, found.group_rank, found.group_world_size)
        self._claim = found
        return found

    def _claim_grow(self, local_world_size: int) -> Vacancy | None:
        """Take the open place of a node the running round shrank around (shrink.py) and record the bigger world this
        node's workers start in; None when there is none, or the record failed (then this node joins as usual)."""
        if self._shrinks is None or not self._round_running():
            return None
        number = self._state_holder.state.round
        try:
            place = self._shrinks.claim(number, self.this_node, local_world_size)
            if place is None:
                return None
            self._round = (number, {**place.ranks, self.this_node: place.group_rank})
            ranks = self.round_ranks()
            world = self._shrinks.grow(number, place, self.this_node, ranks) if ranks is not None else None
        except Exception as e:  # noqa: BLE001 - etcd errors come in several types; a new round still works
            logger.warning("could not take a lost node's place in the running round in place (%s); joining as usual",
                           e)
            self._round = None
            return None
        if world is None:
            logger.warning("took lost node %s's place, but could not record the bigger world; joining as usual",
                           place.lost)
            self._round = None
            return None
        logger.warning("growing round %d back in place: taking lost node %s's place (group rank %d), a world of %d "
                       "(generation %d)", number, place.lost, place.group_rank, world.size, world.generation)
        self.grow_world = world
        return place

    def _round_running(self) -> bool:
        """A completed, open round: the job trains (or its survivors pause in place for a lost node's place)."""
        try:
            self._state_holder.sync()
        except Exception as e:  # noqa: BLE001 - etcd blinked: join as usual
            logger.debug("could not read the rendezvous state: %s", e)
            return False
        state = self._state_holder.state
        return bool(state.complete and not state.closed and state.participants)

    def _round_over(self) -> str | None:
        """Why waiting on this round's store keys is pointless (EtcdStore.abandoned), else None: the rendezvous moved
        to a newer round, which torch does only once every member left this one, the node that writes the keys
        included. Seen in the netns chaos run: a node cut off while a round formed waited out the store's 60 s for
        its ranks while its peers waited for it in the next round."""
        if self._round is None:
            return None
        try:
            self._state_holder.sync()
        except Exception as e:  # noqa: BLE001 - etcd blinked: keep waiting, the timeout still ends it
            logger.debug("could not read the rendezvous state: %s", e)
            return None
        current = self._state_holder.state.round
        if current > self._round[0]:
            return f"rendezvous round {self._round[0]} is over (every member left it; the job is at round {current})"
        return None

    def _take_over(self, claim: Vacancy) -> RendezvousInfo:
        self._claim, self.took_over = None, claim
        store = dist.PrefixStore(f"torch.rendezvous.{self._settings.run_id}.{claim.round}", self._store)
        addr = store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode()
        port = int(store.get(RendezvousStoreInfo.MASTER_PORT_KEY))
        gone = set(self.grow_world.gone) if self.grow_world is not None else set()
        self._round_members = {*claim.ranks, self.this_node} - gone
        self._round = (claim.round, {**claim.ranks, self.this_node: claim.group_rank})
        self._held.clear()
        self._shrunk_round = self.grow_world is not None
        if self.grow_world is not None:
            # Every place taken back so far is news to the survivors only: this node's ranks (`claim.ranks`) already
            # name who holds them now. Seen in a goodput run: the third incarnation of a node read the second's grow
            # (b2 took b1's place) as news, counted b2, dead, as a member, and asked for a new round 5 s later.
            self._grown_seen = {claim.lost}
            try:
                assert self._shrinks is not None  # a grow is claimed through it
                self._grown_seen |= set(self._shrinks.grown(claim.round))
            except Exception as e:  # noqa: BLE001 - etcd blinked: the earlier grows' nodes are then judged by lease
                logger.warning("could not read the round's earlier grows: %s", e)
        self._enter_state(claim)
        self._start_heartbeats()
        return RendezvousInfo(store, claim.group_rank, claim.group_world_size, RendezvousStoreInfo(addr, port))

    def _enter_state(self, claim: Vacancy) -> None:
        """Become a participant of the running round in torch's rendezvous state, in the lost node's place.

        Without it a node that took a place in place trained in the round while the state named only the members
        that formed it: once those were all lost too (their leases gone), the state showed no running round, and a
        node started then formed a round of its own beside the one still training (a split: b lost and taken back
        in place by b2, then a lost too and started again; tests/integration/rendezvous/test_in_place_shrink.py). As
        a participant, with its heartbeat and lease, this node keeps the round alive in the state like any member, and
        leaves it like one."""
        for _ in range(_ENTER_STATE_TRIES):
            try:
                self._state_holder.sync()
                state = self._state_holder.state
                if state.round != claim.round or not state.complete or state.closed:
                    logger.warning("round %d is over (the rendezvous is at round %d); this node trains in it "
                                   "without being named in its state", claim.round, state.round)
                    return
                for node in [n for n in state.participants if node_id(n) == claim.lost]:
                    del state.participants[node]
                    state.last_heartbeats.pop(node, None)
                state.participants[self._this_node] = claim.group_rank
                state.last_heartbeats[self._this_node] = datetime.now(timezone.utc)
                state.wait_list.discard(self._this_node)
                self._state_holder.mark_dirty()
                if self._state_holder.sync():
                    return
            except Exception as e:  # noqa: BLE001 - etcd errors come in several types; the round still trains
                logger.warning("could not name this node in round %d's state (%s)", claim.round, e)
                return
        logger.warning("could not name this node in round %d's state: %d writes lost a race", claim.round,
                       _ENTER_STATE_TRIES)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join plus members of the current round that lost their lease.

        torch's agent calls this every monitor interval and restarts its workers (without spending a
        restart) when it is positive, which is how survivors start a new round after a node loss.
        """
        now = time.monotonic()
        try:
            with self._client.tolerance(_PERIODIC_TOLERANCE_S):
                waiting = super().num_nodes_waiting()
        except (RendezvousConnectionError, EtcdUnavailableError):
            if self._outage_since is None:
                self._outage_since = now
                logger.warning("etcd unreachable; training goes on, retrying")
            if now - self._outage_since > self._client.settings.outage_tolerance:
                raise
            return 0
        if self._outage_since is not None:
            logger.info("etcd reachable again after %.1f s", now - self._outage_since)
            self._outage_since = None
        lost = self._liveness.lost(self._round_members - set(self._held))
        self._lost_seen = {n: self._lost_seen.get(n, now) for n in lost}  # those back or dropped are forgotten
        if self._vacancies is not None and (lost or self._held):
            lost = {n for n in lost if not self._hold(n)} | self._settle_held(now)
        if self._shrinks is not None and (lost or self._doubted):
            lost = self._shrink(lost, waiting, now)
        if self._shrunk_round and now - self._grown_checked >= _GROWN_POLL_S:
            self._grown_checked = now
            self._settle_grown()
        if lost:
            logger.warning("lost node(s) %s of the current round; asking for a new round", sorted(lost))
            self._round_members -= lost
            seen = [self._lost_seen.pop(n) for n in lost if n in self._lost_seen]
            if seen:
                self.members_lost_at = min(seen)
        return waiting + len(lost)

    def _settle_grown(self) -> None:
        """Places of nodes the round shrank around that a new node took back (shrink.py): it is a member now."""
        assert self._shrinks is not None and self._round is not None
        try:
            grown = self._shrinks.grown(self._round[0])
        except Exception as e:  # noqa: BLE001 - etcd blinked: look again at the next tick
            logger.debug("could not read the round's grows: %s", e)
            return
        for lost, node in sorted(grown.items()):
            if lost in self._grown_seen:
                continue
            self._grown_seen.add(lost)
            if node == self.this_node:
                continue
            number, ranks = self._round
            if lost in ranks:
                ranks = dict(ranks)
                ranks[node] = ranks.pop(lost)
                self._round = (number, ranks)
            self._round_members.add(node)
            self._doubted.pop(node, None)
            logger.warning("node %s took lost node %s's place: the round grows back in place", node, lost)
            self.grown.append((lost, node))

    def place_of(self, node: str) -> Vacancy | None:
        """Member `node`'s place in the running round, as a node that takes it over must know it."""
        if self._round is None or node not in self._round[1]:
            return None
        number, ranks = self._round
        rank = ranks[node]
        return Vacancy(lost=node, group_rank=rank, group_world_size=len(ranks), round=number,
                       local_world_size=local_world_size_of(self._wrap_store(self._store), rank),
                       ranks={n: r for n, r in ranks.items() if n != node}, offered_at=time.time())

    @property
    def round_number(self) -> int | None:
        """The rendezvous round this node's workers run in (also after taking a place in place); None before one."""
        return self._round[0] if self._round is not None else None

    def round_ranks(self) -> dict[str, list[int]] | None:
        """Every member's global ranks in the running round (lost members included); None when not known."""
        if self._round is None:
            return None
        number, ranks = self._round
        store = self._wrap_store(self._store)
        sizes: dict[int, int] = {}
        for rank in range(len(ranks)):
            size = local_world_size_of(store, rank) or self.local_world_size
            if size is None:
                return None
            sizes[rank] = size
        return round_ranks(ranks, sizes)

    def _shrink(self, lost: set[str], waiting: int, now: float) -> set[str]:
        """Drop lost members from the running round in place (shrink.py); returns those to report (a new round).

        A member is dropped only on evidence that it is gone: it left in place itself (a drain), or every worker of
        this node pauses in place (their collectives with it failed). A lease alone can lapse on a live node (an
        agent starved of CPU for `lease_ttl`: seen at 150M on 2 cores), and dropping a node whose workers run on
        would split the job. So a member without evidence is doubted for a while (`_DOUBT_S`, re-judged each tick,
        not reported); one that registers again meanwhile, or is still doubted at the end, is reported as before
        (its record left the round's state: a new round)."""
        assert self._shrinks is not None
        alive = self._liveness.alive_nodes()
        back = {n for n in self._doubted if n in alive}
        for node in back:
            del self._doubted[node]
            logger.warning("node %s is back (its etcd lease had lapsed); asking for a new round", node)
        if not lost:
            return back
        report = set(lost) | back
        if self._round is None or waiting > 0 or len(self._round_members - lost) < self._settings.min_nodes:
            return report
        try:
            left = self._shrinks.gone(self._round[0])
            paused = self.workers_paused is not None and self.workers_paused()
            drop = {n for n in lost if n in left or paused}
            for node in lost - drop:
                deadline = self._doubted.setdefault(node, now + max(_DOUBT_S, self._client.settings.lease_ttl))
                if now < deadline:
                    report.discard(node)
                else:
                    del self._doubted[node]
                    logger.warning("node %s lost its lease, but this node's workers did not pause: not dropping it "
                                   "in place", node)
            if not drop:
                return report
            ranks = self.round_ranks()
            if ranks is None:
                return report
            for node in sorted(drop):
                self._doubted.pop(node, None)
                self.shrunk.append((node, self._shrinks.record(self._round[0], node, ranks, self.place_of(node))))
        except Exception as e:  # noqa: BLE001 - etcd errors come in several types; a new round still works
            logger.warning("could not shrink the round in place around lost node(s) %s (%s); asking for a new round",
                           sorted(lost), e)
            return report
        logger.warning("lost node(s) %s of the current round: the round goes on without them, in place", sorted(drop))
        self._round_members -= drop
        self._shrunk_round = True
        return report - drop

    def leave_in_place(self) -> World | None:
        """This node leaves the running round for good (a drain): record it gone, so that the others go on without it
        in place as a smaller world (shrink.py); None when they cannot (fewer than `min_nodes` would be left, a node
        waits to join, shrinking is off, or etcd failed): they re-form in a new round as before."""
        if self._shrinks is None or self._round is None or len(self._round_members) - 1 < self._settings.min_nodes:
            return None
        try:
            if super().num_nodes_waiting() > 0:
                return None
            ranks = self.round_ranks()
            if ranks is None:
                return None
            return self._shrinks.record(self._round[0], self.this_node, ranks, self.place_of(self.this_node))
        except Exception as e:  # noqa: BLE001 - etcd errors come in several types; the others re-form as before
            logger.warning("could not record this node's departure for an in-place shrink (%s); the other nodes "
                           "re-form in a new round", e)
            return None

    def members_left(self) -> int | None:
        """How many members of the running round have not left it in place (shrink.py); None when not known. The
        agents' exit barrier waits for these only: a drained or lost node never reaches it."""
        if self._shrinks is None or self._round is None:
            return None
        return len(set(self._round[1]) - self._shrinks.gone(self._round[0]))

    def world(self, generation: int | None = None) -> World | None:
        """The running round's world at process-group generation `generation` when it shrank in place, else None."""
        if self._shrinks is None or self._round is None:
            return None
        return self._shrinks.world(self._round[0], generation)

    def _hold(self, lost: str) -> bool:
        """Offer lost member `lost`'s place for an in-place take-over; False when that is not possible."""
        assert self._vacancies is not None
        if self._round is None or lost not in self._round[1] or self._shrunk_round:
            # A shrunk round's ranks are no longer the lost node's to hand over: a node started now scales up.
            return False
        vacancy = self.place_of(lost)
        if vacancy is None or not self._vacancies.offer(vacancy):
            return False
        # etcd withdraws the vacancy after hold_s; the deadline here only covers an etcd that cannot tell us so.
        self._held[lost] = time.monotonic() + self._vacancies.hold_s + 10.0
        return True

    def _settle_held(self, now: float) -> set[str]:
        """Held places that were taken (their new node joins the members) or that expired (returned: lost)."""
        assert self._vacancies is not None
        expired: set[str] = set()
        alive = self._liveness.alive_nodes()
        for lost, deadline in list(self._held.items()):
            if lost in alive:
                # Not lost after all: its lease lapsed (an agent starved of CPU for lease_ttl) and it registered
                # again, its workers still running. Nobody may take its place now; its record left the round's
                # state, so a new round it is, as without a held place.
                try:
                    self._vacancies.withdraw(lost)
                except Exception as e:  # noqa: BLE001 - the place's lease ends the offer anyway
                    logger.warning("could not withdraw node %s's held place: %s", lost, e)
                logger.warning("node %s is back (its etcd lease had lapsed); its place is no longer held", lost)
                del self._held[lost]
                expired.add(lost)
                continue
            try:
                # The offer first, then the claim: a claim moves the one to the other in one transaction, so read
                # the other way round a claim landing in between would look like an offer that expired unclaimed.
                still_open = self._vacancies.is_open(lost)
                claimer = None if still_open else self._vacancies.claimer(lost)
            except Exception as e:  # noqa: BLE001 - etcd blinked: judge again at the next tick, or at the deadline
                logger.debug("in-place vacancy of %s: %s", lost, e)
                claimer, still_open = None, True
            if claimer is not None:
                logger.warning("node %s took over lost node %s's place in place", claimer, lost)
                self._round_members = (self._round_members - {lost}) | {claimer}
                if self._round is not None:
                    ranks = dict(self._round[1])
                    ranks[claimer] = ranks.pop(lost)
                    self._round = (self._round[0], ranks)
                del self._held[lost]
            elif not still_open or now > deadline:
                logger.warning("nobody took over lost node %s's place within %.0f s (elastic.rejoin_wait_s)", lost,
                               self._vacancies.hold_s)
                del self._held[lost]
                expired.add(lost)
        return expired

    def _keep_alive(self) -> None:
        # torch's heartbeat holds the lock the monitor loop needs; never let it block for a long outage.
        try:
            with self._client.tolerance(_PERIODIC_TOLERANCE_S):
                super()._keep_alive()
        except Exception as e:  # noqa: BLE001 - torch's timer thread ends at the first error it does not catch
            # torch catches only RendezvousError here, and its timer thread stops for good at any other: the node
            # would never beat again while its lease (the liveness that counts, state.py) still said it lives.
            logger.warning("rendezvous heartbeat of node %s failed (%s); trying again in %.0f s", self.this_node, e,
                           self._settings.keep_alive_interval.total_seconds())

    def shutdown(self) -> bool:
        """Close the rendezvous, then release the lease and the connection."""
        try:
            return super().shutdown()
        finally:
            self._state_holder.unwatch(self._client)
            self._liveness.stop()
            self._client.close()


def _reset_if_finished(client: EtcdClient, backend: EtcdV3Backend, settings: EtcdSettings) -> None:
    """Clear a previous job's closed rendezvous under the same run id, so the id can be reused.

    Only a *closed* state with no live node record is cleared, and only if nobody wrote it since we
    read it (a conditional delete), so a job that is starting concurrently is never disturbed.
    """
    current = backend.get_state()
    if current is None:
        return
    try:
        state = pickle.loads(current[0])
    except Exception:  # noqa: BLE001 - a corrupt state is torch's to report
        return
    if not getattr(state, "closed", False):
        return
    if client.get_prefix(f"{settings.run_prefix}/nodes/"):
        return
    if client.delete_if_revision(backend.key, current[1]):
        client.delete_prefix(f"{settings.run_prefix}/store/")
        # The in-place records are keyed by round, and the new job numbers its rounds from 0 again: an old job's
        # shrinks, places and `finished/<round>` would name the new job's nodes (rendezvous/shrink.py, agent/shrink.py).
        client.delete_prefix(f"{settings.run_prefix}/{IN_PLACE_PREFIX}/")
        logger.info("cleared the finished rendezvous of an earlier job with run id '%s'", settings.run_id)


_PRUNED_ROUND_RETRIES = 3
_ENTER_STATE_TRIES = 10


def pruned_after_completion(ranks: list[int], min_nodes: int) -> str | None:
    """Why a completed round's participants (their group ranks) no longer make the group it completed with, else
    None: torch numbered them 0..n-1 and required `min_nodes`; a member pruned since (its lease expired) leaves a gap
    in the ranks or too few members, and every node reading the round now would get another world than the rest."""
    if len(ranks) < min_nodes:
        return f"{len(ranks)} member(s) left, fewer than min_nodes {min_nodes}"
    if sorted(ranks) != list(range(len(ranks))):
        return f"group ranks {sorted(ranks)} of {len(ranks)} member(s)"
    return None


def _timeout(params: RendezvousParameters, key: str) -> timedelta:
    return timedelta(seconds=conf_seconds(params.config, key))


def create_etcd_handler(params: RendezvousParameters) -> EtcdRendezvousHandler:
    """Create the `etcd3` handler from torchrun's rendezvous parameters (`--rdzv-*`)."""
    settings = EtcdSettings.from_conf(params.endpoint, params.run_id, params.config)
    # Without this, torch's handler would host a TCPStore in the rank-0 agent and hand it to the
    # workers: the single point of failure this backend exists to remove.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    client = EtcdClient(settings)
    client.connect()
    backend = EtcdV3Backend(client, f"{settings.run_prefix}/rdzv")
    _reset_if_finished(client, backend, settings)
    store = EtcdStore(
        client, f"{settings.run_prefix}/store", timeout=timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    )
    rdzv_settings = RendezvousSettings(
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        RendezvousTimeout(
            _timeout(params, "join_timeout"),
            _timeout(params, "last_call_timeout"),
            _timeout(params, "close_timeout"),
            _timeout(params, "heartbeat_timeout"),
        ),
        keep_alive_interval=_timeout(params, "keep_alive_interval"),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", DEFAULTS["keep_alive_max_attempt"]) or 3,
    )
    node = DynamicRendezvousHandler._node_desc_generator.generate(params.local_addr)
    # The presence link listens where torch's rendezvous says this node is reached (--local-addr, else its name).
    liveness = NodeLiveness(client, f"{settings.run_prefix}/nodes", node_id(node), settings.lease_ttl,
                            presence_host=node.addr if conf_flag(params.config, "presence") else None)
    state_holder = LeaseAwareStateHolder(backend, rdzv_settings, liveness)
    # A node record appearing or vanishing changes what the state holder prunes: re-read then.
    liveness.on_change = state_holder.notify
    liveness.start()
    state_holder.watch(client)
    hold_s = conf_seconds(params.config, "in_place_rejoin", allow_zero=True)
    shrink = conf_flag(params.config, "in_place_shrink")
    handler = EtcdRendezvousHandler(node, rdzv_settings, store, state_holder, client, liveness,
                                    rejoin_wait=conf_seconds(params.config, "rejoin_wait", allow_zero=True),
                                    vacancies=Vacancies(client, settings.run_prefix, hold_s) if hold_s > 0 else None,
                                    shrinks=Shrinks(client, settings.run_prefix) if shrink else None)
    logger.info(
        "etcd3 rendezvous '%s' on %s as node %s (lease ttl %s s)",
        params.run_id, settings.endpoints_str(), handler.this_node, settings.lease_ttl,
    )  # fmt: skip
    return handler
