"""The `elastictrain` command."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from elastictrain.cli import ckpt
from elastictrain.errors import ElastictrainError


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train a job from a YAML config on this machine (or as one node of many)",
                       description="Validate the config, then launch the workers under torch.distributed.elastic.")
    p.add_argument("--config", required=True, help="YAML job file, e.g. configs/tiny-cpu.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field, e.g. --set train.steps=200 (repeatable)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="worker processes on this node (default: elastic.nproc_per_node)")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from elastictrain.launcher import launch_local
    from elastictrain.config import load_config

    cfg = load_config(args.config, args.overrides)  # fail fast, before any worker starts
    nproc = args.nproc_per_node or cfg.elastic.nproc_per_node
    return launch_local(args.config, args.overrides, nproc)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastictrain", description="Elastic, fault-tolerant PyTorch training.")
    sub = p.add_subparsers(dest="command", required=True)
    _add_run(sub)
    ckpt.register(sub)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ElastictrainError as e:
        sys.stderr.write(f"elastictrain: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
