"""Sample ledger: which global samples each rank consumed at each step, to prove exactly-once consumption.

Each worker appends one JSON line per completed step to `<dir>/rank{r}.jsonl`. After a restart, steps that
were replayed from a checkpoint appear again under a newer launch id; `committed_timeline` keeps, for each step,
only the records of the newest launch that ran it, which is the history the final model actually saw.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Iterable


class SampleLedger:
    def __init__(self, directory: Path, rank: int, launch_id: str):
        directory.mkdir(parents=True, exist_ok=True)
        self._f = open(directory / f"rank{rank}.jsonl", "a", buffering=1)
        self.rank, self.launch_id = rank, launch_id

    def record(self, step: int, world_size: int, launch_seq: int, samples: Iterable[int]) -> None:
        self._f.write(json.dumps({"step": step, "rank": self.rank, "world_size": world_size,
                                  "launch": self.launch_id, "seq": launch_seq, "samples": list(samples)}) + "\n")

    def close(self) -> None:
        self._f.close()


def read_records(directory: Path) -> list[dict]:
    out = []
    for p in sorted(directory.glob("rank*.jsonl")):
        for line in p.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line torn by a SIGKILL mid-write
    return out


def committed_timeline(directory: Path) -> dict[int, list[int]]:
    """step -> sorted samples of that step, from the newest launch (highest `seq`) that completed it."""
    by_step: dict[int, dict[tuple[int, str], list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in read_records(directory):
        by_step[r["step"]][(r["seq"], r["launch"])].append(r)
    timeline = {}
    for step, launches in by_step.items():
        newest = launches[max(launches)]
        timeline[step] = sorted(s for r in newest for s in r["samples"])
    return timeline
