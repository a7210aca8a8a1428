"""Fixtures for the fault-injection suite: the real CLI, in subprocesses and in-process.

Tests print their figures (``FIGURE <attack>: ...``) and the fuzz tests count their inputs;
both are shown again at the end of the pytest run (a summary only: every test asserts its
own outcome). A group's figure counts the attacks that ran to the end, so a fault test that
failed is named in a last ``FIGURE failed`` line, never left out silently. Figures and
counts travel in each test's teardown report, so the summary is the same with or without
pytest-xdist workers (``make test`` runs them; each file stays on one worker).
"""

from __future__ import annotations

import pytest
from fault_helpers import FIGURES, TALLIES

FAILED: list[str] = []
SHOWN: list[str] = []
COUNTED: dict[str, list[int]] = {}  # attack -> [tried, handled cleanly, ran], all workers


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Hand what this test (and, at a module's end, its group fixture) recorded to the
    teardown report, the one report sent back from a worker after every fixture is done."""
    if call.when == "teardown":
        item.user_properties.extend(("qkgeom_figure", line) for line in FIGURES)
        item.user_properties.extend(("qkgeom_tally", [name, *counts])
                                    for name, counts in TALLIES.items())
        FIGURES.clear()
        TALLIES.clear()
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and "tests/faults/" in report.nodeid.replace("\\", "/"):
        FAILED.append(report.nodeid.rsplit("/", 1)[-1])
    if report.when != "teardown":
        return
    for key, value in report.user_properties:
        if key == "qkgeom_figure":
            SHOWN.append(value)
        elif key == "qkgeom_tally":
            name, *counts = value
            total = COUNTED.setdefault(name, [0, 0, 0])
            total[:] = [a + b for a, b in zip(total, counts, strict=True)]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = list(SHOWN)
    if COUNTED:
        lines.append("FIGURE fuzzing: inputs handled cleanly " + ", ".join(
            f"{name} {clean}/{tried}" + (f" ({ran} accepted and trained)" if ran else "")
            for name, (tried, clean, ran) in sorted(COUNTED.items())))
    if FAILED:
        lines.append(f"FIGURE failed: {len(FAILED)} fault test(s), not in the counts above "
                     f"({'; '.join(FAILED)})")
    if lines:
        terminalreporter.section("fault-injection figures")
        for line in lines:
            terminalreporter.write_line(line)
