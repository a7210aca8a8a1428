"""Fixtures for the fault-injection suite: the real CLI, in subprocesses and in-process.

Tests print their figures (``FIGURE <attack>: ...``) and the fuzz tests count their inputs;
both are shown again at the end of the pytest run (a summary only: every test asserts its
own outcome). A group's figure counts the attacks that ran to the end, so a fault test that
failed is named in a last ``FIGURE failed`` line, never left out silently.
"""

from __future__ import annotations

import pytest
from fault_helpers import FIGURES, TALLIES

FAILED: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and "tests/faults/" in report.nodeid.replace("\\", "/"):
        FAILED.append(report.nodeid.rsplit("/", 1)[-1])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TALLIES:
        FIGURES.append("FIGURE fuzzing: inputs handled cleanly " + ", ".join(
            f"{name} {clean}/{tried}" + (f" ({ran} accepted and trained)" if ran else "")
            for name, (tried, clean, ran) in TALLIES.items()))
    if FAILED:
        FIGURES.append(f"FIGURE failed: {len(FAILED)} fault test(s), not in the counts above "
                       f"({'; '.join(FAILED)})")
    if FIGURES:
        terminalreporter.section("fault-injection figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
