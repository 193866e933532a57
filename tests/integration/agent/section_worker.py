"""A user's script on the public API whose loop has an eval section every N steps (agent tests of sections).

Writes ``<progress-dir>/rank<R>.json`` ({pid, step, restart, in_section}) as worker.py does.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from worker import write_json  # this script's directory is on sys.path

import elastictrain as et


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-s", type=float, default=4.0)
    p.add_argument("--eval-timeout", type=float, default=None)
    p.add_argument("--progress-dir", required=True)
    a = p.parse_args()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    with et.Worker(seed=0) as w:
        progress = os.path.join(a.progress_dir, f"rank{w.rank}.json")
        for step in w.steps(a.steps, et.TrainState()):
            t = torch.ones(1)
            dist.all_reduce(t)
            time.sleep(a.step_s)
            write_json(progress, {"pid": os.getpid(), "step": step, "restart": restart, "in_section": False})
            if step % a.eval_every == a.eval_every - 1:
                with w.section("eval", timeout_s=a.eval_timeout):
                    write_json(progress, {"pid": os.getpid(), "step": step, "restart": restart, "in_section": True})
                    time.sleep(a.eval_s)
                    dist.barrier()
        write_json(os.path.join(a.progress_dir, f"rank{w.rank}.done"), {"pid": os.getpid(), "restart": restart})


if __name__ == "__main__":
    main()
