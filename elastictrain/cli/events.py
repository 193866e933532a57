"""`elastictrain events [--since] [--follow] [--kind K]`: the job's event log, oldest first.

Agents' events, operators' commands, and the checkpoint events the workers report through their agent
(`checkpoint_saved` step, seconds, bytes; `checkpoint_failed` cause; storage full or unreachable; a corrupt
checkpoint skipped at load).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from datetime import datetime
from typing import Any, Optional

from elastictrain.agent.jobstate import event_dict
from elastictrain.agent.status import read_events
from elastictrain.cli import target as tgt
from elastictrain.cli.ckpt import human_bytes
from elastictrain.cli.status import format_event
from elastictrain.errors import ConfigError

_AGO = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: Optional[str], now: Optional[float] = None) -> float:
    """`10m` (ago), a Unix time, or an ISO time (`2026-12-02T12:00:00`, local time unless it has an offset)."""
    if not text:
        return 0.0
    now = time.time() if now is None else now
    m = _AGO.match(text.strip())
    if m:
        return now - float(m.group(1)) * _UNIT[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ConfigError(f"--since {text!r}: use a duration ago (30s, 10m, 2h, 1d), a Unix time or an ISO "
                          f"time (2026-12-02T12:00:00)") from None


def readable(d: dict[str, Any]) -> dict[str, Any]:
    """An event for the text output: a size in bytes as MiB/GiB (`--json` keeps the number)."""
    size = d["fields"].get("bytes")
    if not isinstance(size, int):
        return d
    return {**d, "fields": {**d["fields"], "bytes": human_bytes(size).replace(" ", "")}}


def _cmd_events(args: argparse.Namespace) -> int:
    since = parse_since(args.since)
    target = tgt.connect(args)
    seen: set[tuple[float, str, str]] = set()
    try:
        while True:
            for e in read_events(target.client, target.prefix, since):
                key = (e.time, e.node, e.kind)
                if key in seen:
                    continue
                seen.add(key)
                d = event_dict(e)
                if args.kind and e.kind not in args.kind:
                    continue
                sys.stdout.write((json.dumps(d, default=str) if args.json else format_event(readable(d))) + "\n")
                since = max(since, e.time)
            sys.stdout.flush()
            if not args.follow:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        target.close()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("events", help="the job's event log (join, failure, hang, restart, checkpoint_saved, ...)",
                       description=__doc__)
    tgt.add_target_args(p)
    p.add_argument("--since", default=None, help="only newer events: 30s, 10m, 2h, 1d ago, a Unix or ISO time")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events until interrupted")
    p.add_argument("--kind", action="append", default=[], help="only this kind (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between reads with --follow")
    p.set_defaults(func=_cmd_events)
