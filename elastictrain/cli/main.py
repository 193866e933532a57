"""The `elastictrain` command."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from elastictrain.cli import chaos, ckpt, control, dashboard, events, status
from elastictrain.errors import ElastictrainError


def _add_run(sub: argparse._SubParsersAction) -> None:
    from elastictrain.agent.job import add_run_parser

    add_run_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastictrain", description="Elastic, fault-tolerant PyTorch training.")
    sub = p.add_subparsers(dest="command", required=True)
    _add_run(sub)
    status.register(sub)
    events.register(sub)
    control.register(sub)
    control.register_ckpt_now(ckpt.register(sub))
    dashboard.register(sub)
    chaos.register(sub)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        if args.command == "run":
            from elastictrain.agent.job import main_run

            return main_run(args, extra)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return int(args.func(args) or 0)
    except ElastictrainError as e:
        sys.stderr.write(f"elastictrain: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
