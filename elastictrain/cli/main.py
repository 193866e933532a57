"""The `elastictrain` command."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from elastictrain.errors import ElastictrainError


def _add_run(sub: argparse._SubParsersAction) -> None:
    """`run` in `elastictrain --help`; `main_run` parses its command line (everything after a script is the
    script's), so the agent's modules (and torch) are not imported for other commands."""
    sub.add_parser("run", add_help=False, help="run a job on this node: the recipe from a YAML config, or your own "
                   "script (run the same command on every node)",
                   description="`elastictrain run`: one node of a job (see `elastictrain run --help`).")


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at the top: `elastictrain run` starts its spare workers before anything imports torch.
    # None of these imports torch (tests/unit/test_layers.py checks), so operator commands start in a fraction of
    # a second.
    from elastictrain.cli import chaos, ckpt, control, dashboard, events, status

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
    argv = sys.argv[1:] if argv is None else argv
    spares = None
    if argv[:1] == ["run"]:
        from elastictrain.agent.spares import start_early

        spares = start_early(argv[1:])  # they import alongside ours; the agent adopts them
    try:
        if argv[:1] == ["run"]:
            # Not argparse's: everything after the script is the script's own (its --config, its --set).
            from elastictrain.agent.job import main_run

            return main_run(argv[1:], spares)
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return int(args.func(args) or 0)
    except ElastictrainError as e:
        sys.stderr.write(f"elastictrain: error: {e}\n")
        return 2
    finally:
        if spares is not None:
            spares.close()  # a no-op once the agent has closed the pool it adopted


if __name__ == "__main__":
    sys.exit(main())
