"""A worker module for the warm-pool tests: `prewarm` and `main` leave files that say who ran when."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def prewarm(argv: list[str]) -> None:
    """Record the CPU priority and scheduling policy the imports run at; with a `hold` file in the folder, wait until
    it is removed (a spare still importing)."""
    Path(argv[0], f"prewarmed-{os.getpid()}").write_text(json.dumps(
        {"nice": os.getpriority(os.PRIO_PROCESS, 0), "policy": os.sched_getscheduler(0)}))
    deadline = time.monotonic() + 30
    while Path(argv[0], "hold").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> int:
    out = Path(sys.argv[1])
    (out / f"ran-{os.getpid()}.json").write_text(json.dumps({
        "rank": os.environ.get("RANK"), "argv": sys.argv[1:], "name": __name__,
        "prewarmed": (out / f"prewarmed-{os.getpid()}").exists(), "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "policy": os.sched_getscheduler(0)}))
    print(f"worker {os.environ.get('RANK')} says hello", flush=True)
    return int(sys.argv[2]) if len(sys.argv) > 2 else 0


if __name__ == "__main__":
    sys.exit(main())
