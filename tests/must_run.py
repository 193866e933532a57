"""CI's proof that the tests needing root, namespaces, mounts or a browser ran instead of skipping.

Those tests skip, saying why, where their system is missing, so a plain `pytest` exit 0 does not show that they
ran. `.ci/run` (root, with everything installed) sets ELASTICTRAIN_REQUIRE_MUST_RUN=1; then the session fails,
with one line naming each test and why, when a test listed in tests/must_run.txt did not run, or when any test
skipped (a new skipping test must join the list, and README's count of it, or not skip in CI).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

REQUIRE_ENV = "ELASTICTRAIN_REQUIRE_MUST_RUN"
LIST_PATH = "tests/must_run.txt"
"""The list, relative to the rootdir: one node id a line, `#` comment lines."""


def read_must_run(path: Path) -> list[str]:
    """The node ids listed in `path`."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr: Any = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


class MustRunCheck:
    """Records what ran and what skipped; at the session's end fails it for what should have run."""

    def __init__(self, listed: list[str]) -> None:
        self.listed = listed
        self.ran: set[str] = set()
        self.skipped: dict[str, str] = {}
        self.problems: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skipped[report.nodeid] = _skip_reason(report)
        elif report.when == "call" or report.failed:
            self.ran.add(report.nodeid)

    def find_problems(self) -> list[str]:
        """One phrase per test that should have run here and did not."""
        problems = []
        for nodeid in self.listed:
            if nodeid in self.skipped:
                problems.append(f"{nodeid} skipped ({self.skipped[nodeid]})")
            elif nodeid not in self.ran:
                problems.append(f"{nodeid} never ran")
        problems += [f"{nodeid} skipped ({why}; not in {LIST_PATH})"
                     for nodeid, why in self.skipped.items() if nodeid not in self.listed]
        return problems

    def verdict(self) -> str:
        """The one line that says which tests did not run and why."""
        line = f"{REQUIRE_ENV}=1 and {len(self.problems)} test(s) that must run here did not: "
        line += "; ".join(self.problems)
        if any(p.endswith(" never ran") for p in self.problems):
            line += f" (never ran: deselected, or renamed or removed: then update {LIST_PATH} and README)"
        return line

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.problems = self.find_problems()
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.problems:
            terminalreporter.write_line(self.verdict(), red=True, bold=True)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        listed = read_must_run(config.rootpath / LIST_PATH)
        config.pluginmanager.register(MustRunCheck(listed), "elastictrain-must-run")
