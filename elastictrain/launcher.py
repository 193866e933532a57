"""Launching workers on this node through torch.distributed.elastic (torchrun's engine)."""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)


def recipe_args(config: str, overrides: list[str]) -> list[str]:
    args = ["-m", "elastictrain.recipes.lm", "--config", config]
    for o in overrides:
        args += ["--set", o]
    return args


def launch_local(config: str, overrides: list[str], nproc_per_node: int) -> int:
    """Single-node elastic launch (torchrun --standalone); returns the job's exit code."""
    from torch.distributed.run import get_args_parser, run

    # Workers must not reuse the agent's TCPStore: restarts then fail on its stale keys.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    argv = ["--standalone", "--nproc-per-node", str(nproc_per_node), "--max-restarts", "0",
            *recipe_args(config, overrides)]
    targs = get_args_parser().parse_args(argv)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    try:
        run(targs)
    except ChildFailedError as e:
        first = e.get_first_failure()[1]
        log.error("worker rank %s failed with exit code %s", first.local_rank, first.exitcode)
        return first.exitcode if first.exitcode > 0 else 1
    return 0
