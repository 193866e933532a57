"""The agent's side of a smaller world in place (rendezvous/shrink.py): after the round dropped a lost node, this
node's workers have new global ranks in a smaller world (and again in a bigger one when a node takes a lost node's
place back: a grow). The agent renumbers its view of them (events, status, the
hang rule's world size) and remembers the environment a later in-place replacement of one of them must start with."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from torch.distributed.elastic.agent.server.api import WorkerGroup

from elastictrain.rendezvous.shrink import ENV_ROUND_RANK, World

log = logging.getLogger(__name__)


def adopt_shrinks(worker_group: WorkerGroup, round_ranks: dict[int, int],
                  emit: Callable[..., None]) -> dict[int, dict[str, str]]:
    """Apply the round's shrinks the rendezvous handler recorded since the last call (none: {}). `round_ranks`:
    each local rank's global rank when the round formed. Returns each local rank's environment overrides for a
    replacement started from now on ({} when nothing changed)."""
    handler: Any = worker_group.spec.rdzv_handler
    shrunk = getattr(handler, "shrunk", None)
    if not shrunk:
        return {}
    lost = [node for node, _ in shrunk]
    recorded = [w for _, w in shrunk if w is not None]
    shrunk.clear()
    world: World | None = max(recorded, key=lambda w: w.generation) if recorded else None
    try:
        newest = handler.world()  # the round's newest shrink (another agent may have recorded a later one)
        if newest is not None and (world is None or newest.generation > world.generation):
            world = newest
    except Exception as e:  # noqa: BLE001 - etcd blinked: the record this agent wrote (if any) still tells
        log.debug("could not read the round's shrinks: %s", e)
    if world is None:
        log.warning("lost node(s) %s were dropped from the round in place, but the new world is not readable yet",
                    ", ".join(lost))
        return {}
    old_world = worker_group.workers[0].world_size if worker_group.workers else 0
    overrides = renumber(worker_group, round_ranks, world)
    worker_group.group_world_size = max(1, (worker_group.group_world_size or 1) - len(lost))
    log.warning("the round goes on without lost node(s) %s, in place: world size %d -> %d (generation %d)",
                ", ".join(lost), old_world, world.size, world.generation)
    emit("shrink", reason="node lost", in_place=True, lost_nodes=lost, generation=world.generation,
         world_size=world.size, from_world_size=old_world,
         global_ranks={w.local_rank: w.global_rank for w in worker_group.workers}, recorded_here=bool(recorded))
    return overrides


def renumber(worker_group: WorkerGroup, round_ranks: dict[int, int], world: World) -> dict[int, dict[str, str]]:
    """This node's workers' ranks in `world` (`round_ranks`: each local rank's global rank when the round formed);
    each local rank's environment for a replacement started from now on."""
    overrides: dict[int, dict[str, str]] = {}
    for w in worker_group.workers:
        rank = world.rank_of(round_ranks.get(w.local_rank, w.global_rank))
        if rank is None:  # cannot be: this node is alive; leave the worker as it is, the workers fall back
            continue
        w.global_rank, w.world_size = rank, world.size
        w.role_rank, w.role_world_size = rank, world.size
        overrides[w.local_rank] = {"RANK": str(rank), "WORLD_SIZE": str(world.size), "ROLE_RANK": str(rank),
                                   "ROLE_WORLD_SIZE": str(world.size),
                                   ENV_ROUND_RANK: str(round_ranks.get(w.local_rank, rank))}
    return overrides


def adopt_grows(worker_group: WorkerGroup, round_ranks: dict[int, int],
                emit: Callable[..., None]) -> dict[int, dict[str, str]]:
    """Apply the places taken back in the round since the last call (a node joined the shrunk round in place): this
    node's workers' ranks in the bigger world. Returns the environment overrides like `adopt_shrinks` ({}: none)."""
    handler: Any = worker_group.spec.rdzv_handler
    grown = getattr(handler, "grown", None)
    if not grown:
        return {}
    taken = list(grown)
    grown.clear()
    try:
        world = handler.world()
    except Exception as e:  # noqa: BLE001 - etcd blinked: the workers read the world themselves
        log.warning("could not read the grown round's world: %s", e)
        return {}
    if world is None or not world.joined:
        return {}
    old_world = worker_group.workers[0].world_size if worker_group.workers else 0
    overrides = renumber(worker_group, round_ranks, world)
    worker_group.group_world_size = (worker_group.group_world_size or 1) + len(taken)
    log.warning("node(s) %s joined the round in place (the place of %s): world size %d -> %d (generation %d)",
                ", ".join(n for _, n in taken), ", ".join(lost for lost, _ in taken), old_world, world.size,
                world.generation)
    emit("grow", reason="node joined", in_place=True, joined_nodes=[n for _, n in taken],
         places_of=[lost for lost, _ in taken], generation=world.generation, world_size=world.size,
         from_world_size=old_world, global_ranks={w.local_rank: w.global_rank for w in worker_group.workers},
         recorded_here=False)
    return overrides


FINISHED = "finished"
"""Under the run's in-place prefix: `finished/<round>`, written by a node whose workers finished the job in that round.
A node whose workers wait to grow the round back reads it (its presence is all it says)."""


def record_finished(store: Any, round_number: int) -> None:
    """This node's workers finished the job in round `round_number`: say so to a node that grows the round back."""
    store.set(f"{FINISHED}/{round_number}", b"1")


def finished(store: Any, round_number: int) -> bool:
    """Whether a node's workers finished the job in round `round_number`."""
    return bool(store.check([f"{FINISHED}/{round_number}"]))


def joined(workers: Iterable[Any]) -> bool:
    """Whether workers started to grow a round back have joined its group: one reported a phase past `init` (the
    step loop's `load` comes after the group formed). Every worker beats `init` (step 0) as it starts, so a step
    alone says nothing."""
    return any(w.phase not in (None, "init") for w in workers)
