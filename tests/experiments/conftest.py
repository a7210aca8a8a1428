"""Fixtures for sweep tests: one local sweep of the tiny grid, shared by the modules.

Every run trains the real model on the real sample with one torch thread, so metrics are
bit-for-bit reproducible across processes and backends (CPU, same seed, same threads).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sweep_helpers import tiny_grid

from qkgeom.experiments import SweepSummary, run_sweep


@pytest.fixture(scope="session")
def local_tiny_sweep(sample_data: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SweepSummary]:
    """The 2-run tiny grid swept once with the local backend (2 workers x 1 thread)."""
    out = tmp_path_factory.mktemp("tiny-local")
    summary = run_sweep(tiny_grid(sample_data), out, workers=2, threads_per_run=1,
                        progress=False)
    return out, summary
