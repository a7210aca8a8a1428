"""Fixtures for the data layer: the real embedded dump (the WikiText raw excerpt shipped in
``tests/data/wikitext-raw/`` is the session fixture ``wikitext_raw`` of ``tests/conftest.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qkgeom.data import iter_articles
from qkgeom.data.sources import sample_dump_path


@pytest.fixture(scope="session")
def sample_dump() -> Path:
    """The real shortened enwiki dump shipped in qkgeom (qkgeom/data/sample/)."""
    return sample_dump_path()


@pytest.fixture(scope="session")
def sample_articles(sample_dump: Path) -> list[tuple[str, str]]:
    """The dump converted once per session (the converter is the thing under test)."""
    return list(iter_articles(sample_dump))
