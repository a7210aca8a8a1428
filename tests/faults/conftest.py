"""Fixtures for the fault-injection suite: the real CLI, in subprocesses and in-process.

Every test prints its figure (``FIGURE <attack>: ...``); the lines are collected and shown
again at the end of the pytest run.
"""

from __future__ import annotations

import pytest
from fault_helpers import FIGURES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("fault-injection figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
