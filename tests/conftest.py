"""Shared fixtures: one prepared copy of the embedded Wikipedia sample per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-raw-sample"


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded sample, prepared once into a session cache (the real default corpus)."""
    from qkgeom.data import ensure_sample_data

    return ensure_sample_data(tmp_path_factory.mktemp("qkgeom-cache") / "sample")
