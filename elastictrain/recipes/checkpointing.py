"""Glue between the recipe's Trainer and the CheckpointManager: what to save, when, and how to resume."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from elastictrain.checkpoint.manager import CheckpointManager, EventSink
from elastictrain.config import JobConfig
from elastictrain.runtime.heartbeat import Heartbeat
from elastictrain.runtime.session import Session

if TYPE_CHECKING:
    from elastictrain.recipes.lm import Trainer

log = logging.getLogger(__name__)


def event_sink(heartbeat: Heartbeat, rank: int) -> EventSink:
    """Checkpoint events: logged on every rank, and sent to the job's event log (etcd, via the agent) by rank 0.

    Every rank sees a save or a load alike (DCP makes one rank's failure every rank's), and the events that
    only one rank reports come from rank 0: rank 0's copy is the whole story, once.
    """
    def sink(name: str, fields: dict[str, Any]) -> None:
        log.debug("event %s %s", name, fields, extra={"fields": {"event": name, **fields}})
        if rank == 0:
            # Durations to the millisecond: what an operator reads, and a shorter datagram.
            heartbeat.event(name, **{k: round(v, 3) if isinstance(v, float) else v for k, v in fields.items()})
    return sink


class RecipeCheckpointer:
    """Saves the Trainer's state on the configured schedule, at the end, and on a requested stop."""

    def __init__(self, cfg: JobConfig, trainer: "Trainer", session: Session):
        self.cfg = cfg.checkpoint
        self.mgr = CheckpointManager(
            cfg.checkpoint, fingerprint=cfg.fingerprint(), rank=session.rank, world_size=session.world_size,
            on_event=event_sink(trainer.heartbeat, session.rank),
            extra_metadata={"hf_config": trainer.model.config.to_dict()})
        self._last_saved: Optional[int] = None

    def restore(self, trainer: "Trainer") -> Optional[str]:
        """Load the newest valid checkpoint into the trainer; returns its URL, or None when starting fresh."""
        loaded = self.mgr.load_latest(trainer.state())
        if loaded is None:
            return None
        self._last_saved = loaded.step
        if loaded.missing_keys or loaded.world_size != trainer.session.world_size:
            # This rank's RNG was not in the checkpoint (another world size): derive it from (seed, step, rank).
            trainer.reseed_for_new_world()
        return loaded.url

    def after_step(self, trainer: "Trainer", *, final: bool, stopping: bool) -> None:
        step = trainer.step
        if (final or stopping) and self.cfg.save_on_exit:
            if self._last_saved != step:
                self._save(trainer, blocking=True)
        elif self.mgr.should_save(step):
            self._save(trainer, blocking=False)

    def save_now(self, trainer: "Trainer") -> None:
        """An operator's "checkpoint now": a blocking save at this step (unless this step is already saved)."""
        if self._last_saved != trainer.step:
            log.info("saving step %d on operator request", trainer.step)
            self._save(trainer, blocking=True)

    def _save(self, trainer: "Trainer", blocking: bool) -> None:
        # The agent allows the save phase more time than a step before it calls a worker hung.
        trainer.heartbeat.beat(trainer.step, "save")
        self.mgr.save(trainer.step, trainer.state(), blocking=blocking)
        self._last_saved = trainer.step
        trainer.heartbeat.beat(trainer.step, "train")

    def close(self) -> None:
        self.mgr.close()


def make_checkpointer(cfg: JobConfig, trainer: "Trainer", session: Session) -> Optional[RecipeCheckpointer]:
    if cfg.checkpoint.url is None:
        return None
    return RecipeCheckpointer(cfg, trainer, session)
