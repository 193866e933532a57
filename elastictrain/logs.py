"""Logging setup for entry points: structured, quiet by default, rank-aware."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"t": round(record.created, 3), "level": record.levelname, "logger": record.name,
               "rank": int(os.environ.get("RANK", 0)), "msg": record.getMessage()}
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "INFO", as_json: bool = False, all_ranks: bool = False) -> None:
    """Rank 0 logs at `level`; other ranks only warnings and errors unless `all_ranks`."""
    rank = int(os.environ.get("RANK", 0))
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(_JsonFormatter())
    else:
        fmt = logging.Formatter(f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s", "%H:%M:%S")
        fmt.converter = time.gmtime
        handler.setFormatter(fmt)
    root = logging.getLogger("elastictrain")
    root.handlers[:] = [handler]
    root.propagate = False
    root.setLevel(level if rank == 0 or all_ranks else max(logging.WARNING, logging.getLevelName(level)))
