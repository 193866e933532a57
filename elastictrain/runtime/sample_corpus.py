"""Generates the small English-like corpus shipped as `elastictrain/data/sample_corpus.txt`.

It is written by this deterministic grammar, not downloaded: `python -m elastictrain.runtime.sample_corpus`
rewrites the shipped file bit for bit (a unit test checks that).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

SUBJECTS = ["the operator", "a worker", "the agent", "every rank", "the scheduler", "a node", "the cluster",
            "the checkpoint", "our model", "the optimizer", "a replica", "the etcd lease"]
VERBS = ["restarts", "saves", "loads", "watches", "drains", "re-joins", "shards", "reduces", "trains",
         "verifies", "waits for", "recovers"]
OBJECTS = ["the process group", "a sharded checkpoint", "the data cursor", "its peers", "the global batch",
           "the learning rate", "a heartbeat", "the commit marker", "the next step", "every shard",
           "the rendezvous round", "the loss curve"]
ENDINGS = ["before the deadline", "after a failure", "at a step boundary", "without losing a sample",
           "in a few seconds", "when the lease expires", "on every membership change", "deterministically"]


def generate(n_sentences: int = 6000, seed: int = 7) -> str:
    rng = random.Random(seed)
    lines, line = [], []
    for _ in range(n_sentences):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        if rng.random() < 0.6:
            s += f" {rng.choice(ENDINGS)}"
        line.append(s[0].upper() + s[1:] + ".")
        if len(line) == 4:
            lines.append(" ".join(line))
            line = []
    return "\n".join(lines) + "\n"


def main() -> None:
    default = Path(__file__).resolve().parent.parent / "data" / "sample_corpus.txt"
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    out.write_text(generate())


if __name__ == "__main__":
    main()
