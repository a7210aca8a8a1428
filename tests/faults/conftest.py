"""Fixtures for the fault-injection suite: the real CLI, in subprocesses and in-process.

Tests print their figures (``FIGURE <attack>: ...``) and the fuzz tests count their inputs;
both are shown again at the end of the pytest run (a summary only: every test asserts its
own outcome).
"""

from __future__ import annotations

import pytest
from fault_helpers import FIGURES, TALLIES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TALLIES:
        FIGURES.append("FIGURE fuzzing: inputs handled cleanly " + ", ".join(
            f"{name} {clean}/{tried}" + (f" ({ran} accepted and trained)" if ran else "")
            for name, (tried, clean, ran) in TALLIES.items()))
    if FIGURES:
        terminalreporter.section("fault-injection figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
