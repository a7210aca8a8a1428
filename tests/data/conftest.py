"""Fixtures for the data layer: the real embedded dump, the real WikiText raw sample."""

from __future__ import annotations

from pathlib import Path

import pytest

from qkgeom.data import iter_articles
from qkgeom.data.sources import sample_dump_path

# ../shared from the project root (a user's fresh clone has no ../shared).
WIKITEXT_SAMPLE = (
    Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "wikitext-raw-sample"
)


@pytest.fixture(scope="session")
def sample_dump() -> Path:
    """The real shortened enwiki dump installed by the gensim wheel."""
    return sample_dump_path()


@pytest.fixture(scope="session")
def sample_articles(sample_dump: Path) -> list[tuple[str, str]]:
    """The dump converted once per session (the converter is the thing under test)."""
    return list(iter_articles(sample_dump))


@pytest.fixture(scope="session")
def wikitext_sample() -> Path:
    """Folder with the real WikiText raw valid/test files, or skip."""
    folder = WIKITEXT_SAMPLE.resolve()
    if not (folder / "wiki.valid.raw").is_file() or not (folder / "wiki.test.raw").is_file():
        pytest.skip(
            f"real WikiText raw sample not found at {folder} (it lives in ../shared next to the project)"
        )
    return folder
