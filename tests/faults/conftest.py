"""Fixtures for the fault-injection suite: the real CLI, in subprocesses and in-process.

Tests print their figures (``FIGURE <attack>: ...``) and the fuzz tests count their inputs;
both are shown again at the end of the pytest run by ``tests/conftest.py`` (a summary only:
every test asserts its own outcome). They travel in each test's teardown report, so the
summary is the same with or without pytest-xdist workers (``make test`` runs them; each
file stays on one worker, so a group's figure counts all its attacks).
"""

from __future__ import annotations

import pytest
from fault_helpers import FIGURES, TALLIES


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Hand what this test (and, at a module's end, its group fixture) recorded to the
    teardown report, the one report made after every fixture of the test is done."""
    if call.when == "teardown":
        item.user_properties.extend(("qkgeom_figure", line) for line in FIGURES)
        item.user_properties.extend(("qkgeom_tally", [name, *counts])
                                    for name, counts in TALLIES.items())
        FIGURES.clear()
        TALLIES.clear()
    yield
