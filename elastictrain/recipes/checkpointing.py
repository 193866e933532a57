"""Glue between the recipe's Trainer and the CheckpointManager: what to save, when, and how to resume."""

from __future__ import annotations

from typing import Any, Optional

from elastictrain.config import JobConfig
from elastictrain.runtime.session import Session


def make_checkpointer(cfg: JobConfig, trainer: Any, session: Session) -> Optional[Any]:
    if cfg.checkpoint.url is None:
        return None
    raise NotImplementedError("checkpointing is being wired in")
