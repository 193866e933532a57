"""Tiny elastic worker for the agent tests: gloo all_reduce steps with heartbeats (not the training recipe).

Writes ``<progress-dir>/rank<R>.json`` ({pid, step, restart}) after every step so a test knows when and whom
to hit, and ``rank<R>.done`` when it finishes.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from elastictrain.runtime.heartbeat import Heartbeat


def write_json(path: str, data: dict) -> None:
    """Atomically (the tests poll these files)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--progress-dir", required=True)
    p.add_argument("--sleep-at", default="", help="RANK:STEP:SECONDS: that rank sleeps that long before that step, "
                                                  "in the first launch only (a hang in which every process sleeps)")
    a = p.parse_args()
    sleep_rank, sleep_step, sleep_s = (int(a.sleep_at.split(":")[0]), int(a.sleep_at.split(":")[1]),
                                       float(a.sleep_at.split(":")[2])) if a.sleep_at else (-1, -1, 0.0)

    hb = Heartbeat.from_env()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    progress = os.path.join(a.progress_dir, f"rank{rank}.json")
    for step in range(1, a.steps + 1):
        if (rank, step, restart) == (sleep_rank, sleep_step, 0):
            time.sleep(sleep_s)
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(a.step_s)
        hb.beat(step, "train")
        write_json(progress, {"pid": os.getpid(), "step": step, "restart": restart})
    hb.beat(a.steps, "done")
    dist.barrier()
    dist.destroy_process_group()
    write_json(os.path.join(a.progress_dir, f"rank{rank}.done"), {"pid": os.getpid(), "restart": restart})


if __name__ == "__main__":
    main()
