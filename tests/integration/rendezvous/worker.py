"""Tiny elastic worker for the rendezvous tests and benchmark: gloo all_reduce steps, progress to a file.

Each step appends one line `time step rank world_size group_world restart` to
`$PROGRESS_DIR/<NODE_TAG>-<LOCAL_RANK>.log`. The step counter continues from the largest step any
rank logged (read from the shared progress dir and agreed by all_reduce MAX), so a re-formed group
carries on instead of starting over.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def _last_step(progress: Path) -> int:
    last = 0
    for path in progress.glob("*.log"):
        for line in path.read_text().splitlines()[-1:]:
            parts = line.split()
            if len(parts) >= 2:
                last = max(last, int(parts[1]))
    return last


def main() -> None:
    progress = Path(os.environ["PROGRESS_DIR"])
    total = int(os.environ.get("TOTAL_STEPS", "100000"))
    step_s = float(os.environ.get("STEP_SECONDS", "0.1"))
    tag = os.environ.get("NODE_TAG", "node")
    # A short collective timeout: a peer lost in a network cut must fail us in seconds, not 30 min.
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("PG_TIMEOUT", "30"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    start = torch.tensor([_last_step(progress)], dtype=torch.int64)
    dist.all_reduce(start, op=dist.ReduceOp.MAX)
    out = progress / f"{tag}-{os.environ.get('LOCAL_RANK', '0')}.log"
    step = int(start.item())
    while step < total:
        step += 1
        value = torch.ones(4)
        dist.all_reduce(value)
        assert int(value[0].item()) == world
        with out.open("a") as f:
            f.write(f"{time.time():.3f} {step} {rank} {world} {os.environ.get('GROUP_WORLD_SIZE')} {restart}\n")
        time.sleep(step_s)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
