"""tests/must_run.py: with ELASTICTRAIN_REQUIRE_MUST_RUN=1 (CI) a skipped or missing must-run test fails pytest."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import must_run
from tests.must_run import LIST_PATH, REQUIRE_ENV, read_must_run

REPO = Path(__file__).resolve().parents[2]

SUITE = """
import os, pytest

def test_needs_root():
    if os.environ.get("FAKE_ROOT") != "1":
        pytest.skip("needs root to create network namespaces")

@pytest.mark.skipif(os.environ.get("FAKE_CHROMIUM") != "1", reason="no chromium on PATH")
def test_needs_chromium():
    pass

def test_plain():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A tiny suite with two tests that skip unless FAKE_ROOT / FAKE_CHROMIUM say their system is there."""
    pytester.makepyfile(**{"tests/test_sys": SUITE})
    pytester.path.joinpath(LIST_PATH).write_text(
        "# needs root\ntests/test_sys.py::test_needs_root\n\ntests/test_sys.py::test_needs_chromium\n")
    for name in (REQUIRE_ENV, "FAKE_ROOT", "FAKE_CHROMIUM"):
        monkeypatch.delenv(name, raising=False)
    return pytester


def _run(suite: pytest.Pytester, *args: str) -> pytest.RunResult:
    return suite.runpytest("-p", "tests.must_run", *args)


def _verdict(result: pytest.RunResult) -> list[str]:
    return [line for line in result.outlines if line.startswith(f"{REQUIRE_ENV}=1")]


def test_a_skipped_must_run_test_fails_ci_with_one_line_naming_it_and_why(suite, monkeypatch):
    monkeypatch.setenv(REQUIRE_ENV, "1")
    monkeypatch.setenv("FAKE_CHROMIUM", "1")
    result = _run(suite)
    result.assert_outcomes(passed=2, skipped=1)  # pytest alone would exit 0
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert _verdict(result) == [f"{REQUIRE_ENV}=1 and 1 test(s) that must run here did not: "
                                "tests/test_sys.py::test_needs_root skipped (needs root to create network namespaces)"]


def test_skipif_marks_are_caught_too_and_every_skip_is_named(suite, monkeypatch):
    monkeypatch.setenv(REQUIRE_ENV, "1")
    (line,) = _verdict(_run(suite))
    assert "2 test(s)" in line and "test_needs_root skipped (needs root" in line
    assert "tests/test_sys.py::test_needs_chromium skipped (no chromium on PATH)" in line


def test_skips_are_fine_without_the_switch(suite):
    result = _run(suite)
    result.assert_outcomes(passed=1, skipped=2)
    assert result.ret == pytest.ExitCode.OK and _verdict(result) == []


def test_passes_when_every_must_run_test_ran(suite, monkeypatch):
    for name in (REQUIRE_ENV, "FAKE_ROOT", "FAKE_CHROMIUM"):
        monkeypatch.setenv(name, "1")
    result = _run(suite)
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.OK and _verdict(result) == []


def test_a_listed_test_that_was_renamed_away_fails_ci(suite, monkeypatch):
    monkeypatch.setenv(REQUIRE_ENV, "1")
    monkeypatch.setenv("FAKE_ROOT", "1")
    monkeypatch.setenv("FAKE_CHROMIUM", "1")
    suite.path.joinpath(LIST_PATH).write_text("tests/test_sys.py::test_needs_root\ntests/test_sys.py::test_gone\n")
    result = _run(suite)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    (line,) = _verdict(result)
    assert line == (f"{REQUIRE_ENV}=1 and 1 test(s) that must run here did not: tests/test_sys.py::test_gone never "
                    f"ran (never ran: deselected, or renamed or removed: then update {LIST_PATH} and README)")


def test_a_skip_missing_from_the_list_fails_ci(suite, monkeypatch):
    monkeypatch.setenv(REQUIRE_ENV, "1")
    monkeypatch.setenv("FAKE_CHROMIUM", "1")
    suite.path.joinpath(LIST_PATH).write_text("tests/test_sys.py::test_needs_chromium\n")
    (line,) = _verdict(_run(suite))
    assert f"tests/test_sys.py::test_needs_root skipped (needs root to create network namespaces; not in {LIST_PATH})" \
           in line


def test_every_listed_test_exists():
    for nodeid in read_must_run(REPO / LIST_PATH):
        path, name = nodeid.split("::")
        name = name.split("[", 1)[0]  # a parametrized case: its test function
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{nodeid}: no such test"


def test_readme_counts_and_names_exactly_the_listed_tests():
    listed = read_must_run(REPO / LIST_PATH)
    section = (REPO / "README.md").read_text().split("## Tests and benchmarks", 1)[1].split("\n## ", 1)[0]
    numbers = {"One": 1, "Two": 2, "Three": 3, "Four": 4, "Five": 5, "Six": 6, "Seven": 7, "Eight": 8}
    count = re.search(r"(\w+) tests? needs?\s+root\s+or\s+system\s+packages\s+and\s+skips?\s+elsewhere", section)
    word = count.group(1) if count else ""
    assert count and (int(word) if word.isdigit() else numbers[word]) == len(listed), \
        "README's count of tests that may skip is stale"
    bullets = [int(n) for n in re.findall(r"^- (\d+) needs? ", section, re.M)]
    assert sum(bullets) == len(listed)
    for nodeid in listed:
        assert f"`{nodeid.split('::')[0]}`" in section, f"README does not name {nodeid}"


def test_ci_sets_the_switch_before_running_readmes_test_command_verbatim():
    readme = (REPO / "README.md").read_text()
    command = re.search(r"\*\*Install and pass the tests\*\*.*?```bash\n(.+?)\n```", readme, re.S).group(1)
    ci = (REPO / ".ci/run").read_text()
    assert f"\n{command}\n" in ci, ".ci/run must run README's test command exactly as written, on a line of its own"
    assert f"\nexport {REQUIRE_ENV}=1\n" in ci.split(command)[0]


def test_the_plugin_is_loaded_by_the_suite(pytestconfig):
    assert pytestconfig.pluginmanager.is_registered(must_run)
