"""Shared fixtures: one prepared copy of the embedded Wikipedia sample per test session, and
the excerpt of the real WikiText raw files shipped in ``tests/data/wikitext-raw/``."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The first whole articles of the real WikiText raw valid/test files (see its README.md).
WIKITEXT_RAW = ROOT / "tests" / "data" / "wikitext-raw"


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
