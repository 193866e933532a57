"""Operator commands start fast: building the CLI (every subcommand but `run`) does not import torch.

torch costs 3-4 s of CPU per process; `elastictrain status` run in a loop by an operator or a monitoring script
paid that on every call.
"""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = r"""
import json, sys
from elastictrain.cli.main import build_parser
import elastictrain.cli.status, elastictrain.cli.events, elastictrain.cli.control  # noqa: E401,F401
import elastictrain.cli.dashboard, elastictrain.cli.chaos, elastictrain.cli.ckpt  # noqa: E401,F401
parser = build_parser()
print(json.dumps({"torch": "torch" in sys.modules, "commands": sorted(parser._subparsers._group_actions[0].choices)}))
"""


def test_building_the_cli_imports_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {"run", "status", "events", "drain", "pause", "resume", "ckpt", "dashboard", "chaos"}
    assert expected <= set(seen["commands"])
    assert seen["torch"] is False, "an operator command imports torch again (3-4 s per call): see -X importtime"


def test_run_help_still_lists_the_agent_and_torchrun_flags() -> None:
    out = subprocess.run([sys.executable, "-m", "elastictrain.cli.main", "run", "--help"], capture_output=True,
                         text=True, timeout=120, check=True)
    assert "--nnodes" in out.stdout and "--config" in out.stdout
