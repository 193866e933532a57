"""A lost node's place in the running round, held for a new node to take over in place (no new round).

With `elastic.in_place` and `elastic.rejoin_wait_s` > 0 (`--rdzv-conf in_place_rejoin=<s>`): the survivors' agents
see the lost node's lease expire (rendezvous/liveness.py). Instead of asking for a new round at once, the first of
them offers the lost node's group rank as a **vacancy**: `<run>/inplace/vacant/<group_rank>`, bound to an etcd lease
of `rejoin_wait_s`, so it is withdrawn by etcd itself when nobody takes it in time (also when every survivor dies).
A node started meanwhile (the same command, on the same host or another one) claims a vacancy of its local world size
before it would join a round: one transaction deletes the vacancy and writes `claimed/<lost node>`, so two new nodes
never take the same place and an expired vacancy cannot be claimed. Its workers take the lost node's global ranks in
a new process-group generation (runtime/inplace.py) that the survivors' workers, paused in place, join. A vacancy
that expires unclaimed makes the survivors ask for a new round, as without it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from elastictrain.rendezvous.client import EtcdClient

log = logging.getLogger(__name__)

PREFIX = "inplace"
"""Under the run's prefix, beside the process-group generations (runtime/inplace.py)."""


@dataclass
class Vacancy:
    """The place of a lost node in round `round`: its group rank and what a node must bring to take it."""

    lost: str
    """The lost node's id."""
    group_rank: int
    group_world_size: int
    round: int
    local_world_size: Optional[int]
    """Its number of workers (None: not known; any node may take it)."""
    ranks: dict[str, int]
    """The round's other nodes (the survivors) and their group ranks, for the new node's own loss handling."""
    offered_at: float

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Vacancy":
        d = json.loads(raw)
        return cls(str(d["lost"]), int(d["group_rank"]), int(d["group_world_size"]), int(d["round"]),
                   None if d.get("local_world_size") is None else int(d["local_world_size"]),
                   {str(n): int(r) for n, r in (d.get("ranks") or {}).items()}, float(d.get("offered_at", 0.0)))


class Vacancies:
    """The run's vacancies and claims in etcd."""

    def __init__(self, client: EtcdClient, run_prefix: str, hold_s: float):
        self.client, self.hold_s = client, hold_s
        self._vacant = f"{run_prefix}/{PREFIX}/vacant/"
        self._claimed = f"{run_prefix}/{PREFIX}/claimed/"

    def offer(self, vacancy: Vacancy) -> bool:
        """Hold `vacancy` for `hold_s` (whoever offers first; a repeat or a peer's offer finds it there). False when
        it could not be written (etcd down): the caller asks for a new round instead."""
        key = f"{self._vacant}{vacancy.group_rank}"
        try:
            found = self.client.get(key)
            if found is not None and Vacancy.from_json(found[0]).lost == vacancy.lost:
                return True
            lease = self.client.lease_grant(max(2, math.ceil(self.hold_s)))
            self.client.put(key, vacancy.to_json(), lease=lease)
        except Exception as e:  # noqa: BLE001 - etcd errors come in several types; the fallback is a new round
            log.warning("could not offer lost node %s's place for an in-place re-join: %s", vacancy.lost, e)
            return False
        log.warning("node %s (group rank %d) is lost; its place is held %.0f s for a node to take over in place "
                    "(elastic.rejoin_wait_s)", vacancy.lost, vacancy.group_rank, self.hold_s)
        return True

    def is_open(self, lost: str) -> bool:
        """Whether lost node `lost`'s vacancy is still offered (not claimed, not expired)."""
        return any(v.lost == lost for v, _ in self._listed())

    def claimer(self, lost: str) -> Optional[str]:
        """The node that took lost node `lost`'s place, or None."""
        found = self.client.get(f"{self._claimed}{lost}")
        return json.loads(found[0])["node"] if found is not None else None

    def claim(self, node: str, local_world_size: int) -> Optional[Vacancy]:
        """Take an open vacancy of `local_world_size` workers for `node` (the lowest group rank first); None when
        there is none or another node took each one first."""
        return take_first(self.client, listed(self.client, self._vacant), node, local_world_size,
                          lambda v: f"{self._claimed}{v.lost}")

    def _listed(self) -> list[tuple[Vacancy, int]]:
        return [(vacancy, revision) for _, vacancy, revision in listed(self.client, self._vacant)]

    def withdraw(self, lost: str) -> bool:
        """Take lost node `lost`'s place off offer (it came back: its lease had lapsed, its workers run on); True
        when it was still open, False when it was already claimed or gone."""
        for vacancy, revision in self._listed():
            if vacancy.lost == lost:
                return self.client.delete_if_revision(f"{self._vacant}{vacancy.group_rank}", revision)
        return False

    def clear_claims(self) -> None:
        """Forget old claims (a new round: their nodes are members of it like any other)."""
        self.client.delete_prefix(self._claimed)


def listed(client: EtcdClient, prefix: str) -> list[tuple[str, Vacancy, int]]:
    """The places offered under `prefix`: (key, place, mod revision), the lowest group rank first."""
    out = []
    for key, (value, revision) in client.get_prefix_revisions(prefix).items():
        try:
            out.append((key, Vacancy.from_json(value), revision))
        except (ValueError, KeyError, TypeError) as e:
            log.warning("ignoring an unreadable in-place place %s: %s", key, e)
    return sorted(out, key=lambda kvr: kvr[1].group_rank)


def take_first(client: EtcdClient, places: list[tuple[str, Vacancy, int]], node: str, local_world_size: int,
               moved_to: Callable[[Vacancy], str]) -> Optional[Vacancy]:
    """Claim the first of `places` (`listed`) that fits a node of `local_world_size` workers for `node`: its key
    moved to `moved_to(place)` in one transaction, so two nodes never take the same place. None when none is left."""
    for key, place, revision in places:
        if place.local_world_size not in (None, local_world_size):
            log.info("not taking lost node %s's place: it ran %d workers, this node runs %d", place.lost,
                     place.local_world_size, local_world_size)
            continue
        record = json.dumps({"node": node, "group_rank": place.group_rank, "at": time.time()}).encode()
        if client.move(key, revision, moved_to(place), record):
            return place
    return None


def local_world_size_of(round_store: Any, group_rank: int) -> Optional[int]:
    """The local world size torch's agent of `group_rank` wrote into its round's store (`_assign_worker_ranks`'
    role info); None when it is not there (an identical-workers launch) or not readable."""
    try:
        if not round_store.check([f"torchelastic/role_info/{group_rank}"]):
            return None
        return int(json.loads(round_store.get(f"torchelastic/role_info/{group_rank}"))["local_world_size"])
    except Exception:  # noqa: BLE001 - torch's private format may change: any node may then take the place
        return None
