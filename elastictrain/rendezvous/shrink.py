"""A smaller world in place: a lost node that nobody replaces is dropped from the running round, and the survivors'
workers re-form a smaller process group inside their processes (runtime/inplace.py) instead of a new round.

With `elastic.in_place` and `elastic.in_place_shrink` (`--rdzv-conf in_place_shrink=1`), a survivor's agent that sees
a member's etcd lease expire (and no place held for it, or its held place expired unclaimed) does not ask for a new
round while the round keeps at least `min_nodes` members and no node waits to join. Instead the first agent to do so
records the loss in one etcd transaction (`<run>/inplace/shrink/<round>/gone/<node>`, created only if absent: one
writer per lost node), starts a new process-group generation and writes the world of that generation beside it
(`.../shrink/<round>/world/<N>`): the **round ranks** that survive. A worker's round rank is the global rank it got when
its round formed (`ENV_ROUND_RANK` for a replacement started later); its new rank is its index among the survivors.

The world of a generation is computed from every `gone/` key of the round, read after the counter moved: the newest
generation's record therefore names every node lost before it, also when two agents recorded two losses at once.

**A grow in place** (the way back): the lost node's place stays open (`.../open/<node>`, the round's group rank and
what a node must bring to take it) for as long as the round runs. A node started later (the lost one again, or
another) claims it before it would join a new round: one transaction moves `open/<node>` to `back/<node>`, so two
nodes never take the same place. The claimer then deletes `gone/<node>`, starts a new generation and writes its world
(`world/<N>` with `joined`: the round ranks it brings back). Its workers start in that generation, say they are ready
(`<run>/inplace/g<N>/ready/<rank>`, runtime/inplace.py) and wait in the group's rendezvous; the survivors' workers,
training meanwhile, see the grow once every joiner is ready, stop together at the next step boundary with that step's
snapshot taken, and re-form with them: a bigger world, the model built on the new mesh, the snapshot loaded
re-sharded (the joiners copy their slots from the survivors' nodes). Nobody restarts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Optional

from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.store import EtcdStore
from elastictrain.rendezvous.vacancy import Vacancy, listed, take_first

log = logging.getLogger(__name__)

PREFIX = "inplace"
"""Under the run's prefix: the generation counter (`gen`, runtime/inplace.py) and `shrink/<round>/`."""
ENV_ROUND = "ELASTICTRAIN_ROUND"
"""Set on every worker by its agent: the rendezvous round its group formed in."""
ENV_ROUND_RANK = "ELASTICTRAIN_ROUND_RANK"
"""Set on a worker started after its round shrank: the global rank its place had when the round formed."""


@dataclass(frozen=True)
class World:
    """The ranks of a shrunk (or shrunk, then grown) round at a generation: `survivors[i]` is the round rank that now
    has rank i."""

    generation: int
    survivors: tuple[int, ...]
    gone: tuple[str, ...]
    joined: tuple[int, ...] = ()
    """A grow: the round ranks a node brought back at this generation (its workers are new; the others' are not)."""

    @property
    def size(self) -> int:
        return len(self.survivors)

    def rank_of(self, round_rank: int) -> Optional[int]:
        return self.survivors.index(round_rank) if round_rank in self.survivors else None


def round_ranks(group_ranks: dict[str, int], local_world_sizes: dict[int, int]) -> dict[str, list[int]]:
    """Each node's global ranks in its round, as torch numbers them: a node's local ranks follow every node of a
    lower group rank (`local_world_sizes`: group rank -> its number of workers)."""
    out: dict[str, list[int]] = {}
    by_rank = {r: n for n, r in group_ranks.items()}
    base = 0
    for group_rank in range(max(local_world_sizes) + 1 if local_world_sizes else 0):
        size = local_world_sizes[group_rank]
        if group_rank in by_rank:
            out[by_rank[group_rank]] = list(range(base, base + size))
        base += size
    return out


class Shrinks:
    """The run's in-place shrinks in etcd."""

    def __init__(self, client: EtcdClient, run_prefix: str):
        self.client = client
        self._prefix = f"{run_prefix}/{PREFIX}/shrink"
        self._generations = EtcdStore(client, f"{run_prefix}/{PREFIX}")

    def _round(self, number: int) -> str:
        return f"{self._prefix}/{number}"

    def record(self, round_number: int, lost: str, ranks: dict[str, list[int]],
               place: Optional[Vacancy] = None) -> Optional[World]:
        """Record node `lost` gone from round `round_number` (`ranks`: every member's round ranks, the lost ones
        included) and, with `place`, keep its place open for a node that grows the round back. The world of the new
        generation when this call recorded it; None when another agent did."""
        written, _, _ = self.client.cas(f"{self._round(round_number)}/gone/{lost}", b"1", None)
        if not written:
            return None
        if place is not None:
            self.client.put(f"{self._round(round_number)}/open/{lost}", place.to_json())
        world = self._record_world(round_number, ranks)
        if world is not None:
            log.warning("node(s) %s left round %d: its %d surviving ranks continue in place as a smaller world "
                        "(generation %d)", ", ".join(world.gone), round_number, world.size, world.generation)
        return world

    def _record_world(self, round_number: int, ranks: dict[str, list[int]],
                      joined: tuple[int, ...] = ()) -> Optional[World]:
        generation = int(self._generations.add("gen", 1))
        gone = tuple(sorted(self.gone(round_number)))
        survivors = tuple(sorted(r for node, rs in ranks.items() if node not in gone for r in rs))
        if not survivors:  # cannot be while the recording agent is alive; never leave an empty world to join
            return None
        world = World(generation, survivors, gone, joined)
        self.client.put(f"{self._round(round_number)}/world/{generation}",
                        json.dumps({"survivors": list(survivors), "gone": list(gone), "joined": list(joined)}).encode())
        return world

    def claim(self, round_number: int, node: str, local_world_size: int) -> Optional[Vacancy]:
        """Take an open place of round `round_number` (a node it shrank around) for `node`, which runs
        `local_world_size` workers; None when there is none (or another node took each one first)."""
        return take_first(self.client, listed(self.client, f"{self._round(round_number)}/open/"), node,
                          local_world_size, lambda place: f"{self._round(round_number)}/back/{place.lost}")

    def grow(self, round_number: int, place: Vacancy, node: str, ranks: dict[str, list[int]]) -> Optional[World]:
        """`node` took lost node `place.lost`'s place (`claim`): record the bigger world of a new generation, in
        which it holds that node's round ranks (`ranks`: every member's round ranks, `node` under its own name)."""
        self.client.delete(f"{self._round(round_number)}/gone/{place.lost}")
        world = self._record_world(round_number, ranks, joined=tuple(sorted(ranks.get(node, ()))))
        if world is not None:
            log.warning("node %s takes lost node %s's place in round %d in place: a world of %d (generation %d)",
                        node, place.lost, round_number, world.size, world.generation)
        return world

    def grown(self, round_number: int) -> dict[str, str]:
        """The round's places taken back: lost node -> the node that took its place."""
        prefix = f"{self._round(round_number)}/back/"
        out = {}
        for key, raw in self.client.get_prefix(prefix).items():
            try:
                out[key.removeprefix(prefix)] = str(json.loads(raw)["node"])
            except (ValueError, KeyError, TypeError) as e:
                log.warning("ignoring an unreadable in-place grow record %s: %s", key, e)
        return out

    def gone(self, round_number: int) -> set[str]:
        prefix = f"{self._round(round_number)}/gone/"
        return {k.removeprefix(prefix) for k in self.client.get_prefix(prefix)}

    def world(self, round_number: int, generation: Optional[int] = None) -> Optional[World]:
        """The world of round `round_number` at `generation` (None: now): its newest shrink at or before it; None
        when the round has not shrunk by then."""
        prefix = f"{self._round(round_number)}/world/"
        best: Optional[World] = None
        for key, raw in self.client.get_prefix(prefix).items():
            try:
                number = int(key.removeprefix(prefix))
                data: dict[str, Any] = json.loads(raw)
            except (ValueError, TypeError) as e:
                log.warning("ignoring an unreadable in-place shrink record %s: %s", key, e)
                continue
            if (generation is None or number <= generation) and (best is None or number > best.generation):
                best = World(number, tuple(int(r) for r in data["survivors"]),
                             tuple(str(n) for n in data.get("gone", ())), tuple(int(r) for r in data.get("joined", ())))
        return best

    def forget_before(self, round_number: int) -> None:
        """Drop the records of rounds older than `round_number` (a new round numbers its ranks afresh)."""
        for key in self.client.get_prefix(f"{self._prefix}/"):
            head = key.removeprefix(f"{self._prefix}/").split("/", 1)[0]
            if head.isdigit() and int(head) < round_number:
                self.client.delete_prefix(f"{self._prefix}/{head}/")
