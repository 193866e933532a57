"""Between the step loop and the CheckpointManager: what to save, when, and how to resume a `TrainState`."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Optional

from elastictrain.checkpoint.manager import CheckpointManager, EventSink, LoadedCheckpoint
from elastictrain.config import CheckpointConfig
from elastictrain.runtime.heartbeat import Heartbeat
from elastictrain.runtime.train_state import TrainState

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


def fingerprint_of(parts: dict[str, Any]) -> dict[str, str]:
    """A checkpoint fingerprint from plain data (the user's config): strings as given, else a short hash of each."""
    return {str(k): v if isinstance(v, str) else
            hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
            for k, v in parts.items()}


class StateCheckpointer:
    """Saves a `TrainState` on the configured schedule, at the end and on a stop; restores the newest valid one."""

    def __init__(self, cfg: CheckpointConfig, state: TrainState, heartbeat: Heartbeat, *, rank: int,
                 world_size: int, fingerprint: dict[str, str], metadata: Optional[dict[str, Any]] = None):
        self.cfg, self.state, self.heartbeat, self.rank = cfg, state, heartbeat, rank
        self.mgr = CheckpointManager(cfg, fingerprint=fingerprint, rank=rank, world_size=world_size,
                                     on_event=event_sink(heartbeat, rank), extra_metadata=metadata)
        self._last_saved: Optional[int] = None

    def restore(self) -> Optional[LoadedCheckpoint]:
        """Load the newest valid checkpoint into the state; None when starting fresh."""
        loaded = self.mgr.load_latest(self.state.checkpoint_state(self.rank))
        if loaded is not None:
            self._last_saved = loaded.step
        return loaded

    def after_step(self, *, final: bool, stopping: bool) -> None:
        step = self.state.step
        if (final or stopping) and self.cfg.save_on_exit:
            if self._last_saved != step:
                self._save(blocking=True)
        elif self.mgr.should_save(step):
            self._save(blocking=False)

    def save_now(self) -> None:
        """An operator's "checkpoint now": a blocking save at this step (unless this step is already saved)."""
        if self._last_saved != self.state.step:
            log.info("saving step %d on operator request", self.state.step)
            self._save(blocking=True)

    def _save(self, blocking: bool) -> None:
        step = self.state.step
        # The agent allows the save phase more time than a step before it calls a worker hung.
        self.heartbeat.beat(step, "save")
        self.mgr.save(step, self.state.checkpoint_state(self.rank), blocking=blocking)
        self._last_saved = step
        self.heartbeat.beat(step, "train")

    def close(self) -> None:
        self.mgr.close()
