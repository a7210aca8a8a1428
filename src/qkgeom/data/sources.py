"""Corpus sources: each returns the raw text of the splits ``{"train", "val", "test"}``.

Every source (the embedded Wikipedia sample, WikiText-103 from files or ``datasets``, any
UTF-8 text, a Wikipedia dump) ends up as three strings, deterministically, so the
vocabulary, encoding and checks live in one place (:mod:`.prepare`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from qkgeom.data.wikidump import iter_articles
from qkgeom.errors import QKGeomError, first_line
from qkgeom.io import read_file

__all__ = ["SPLITS", "SAMPLE_DUMP", "SAMPLE_DUMP_SHA256", "WIKITEXT_FILES", "sample_dump_path",
           "sample_splits", "wikidump_splits", "split_articles", "wikitext103_splits",
           "wikitext103_pieces", "text_splits", "read_utf8", "text_files", "input_files"]

SPLITS = ("train", "val", "test")
#: The real (shortened) May 2016 enwiki dump excerpt shipped in this package (the file
#: gensim's test data holds, byte for byte; origin and licence: ``data/SAMPLE_LICENSE``).
SAMPLE_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
#: Its SHA-256: the sample's provenance, recorded in every prepared sample's meta.json.
SAMPLE_DUMP_SHA256 = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"
#: WikiText raw file per split.
WIKITEXT_FILES = {"train": "wiki.train.raw", "val": "wiki.valid.raw", "test": "wiki.test.raw"}
#: Share of characters (at least) that goes to each held-out split of an article corpus.
HELD_OUT_FRACTION = 0.05
_HF_DATASET, _HF_CONFIG = "Salesforce/wikitext", "wikitext-103-raw-v1"
_HF_SPLITS = {"train": "train", "val": "validation", "test": "test"}


def sample_dump_path() -> Path:
    """Path of the Wikipedia dump excerpt shipped inside qkgeom (``qkgeom/data/sample/``),
    so the offline default corpus needs no other package."""
    path = Path(__file__).resolve().parent / "sample" / SAMPLE_DUMP
    if not path.is_file():
        raise QKGeomError(f"{path}: the embedded Wikipedia sample is missing from the qkgeom "
                          "install; reinstall qkgeom (`pip install --force-reinstall qkgeom`)")
    return path


def _article_key(title: str) -> bytes:
    return hashlib.sha256(title.encode("utf-8")).digest()


def split_articles(articles: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Whole articles into train/val/test, so held-out text comes from articles never
    trained on (as in WikiText): in the order of their titles' SHA-256, val then test take
    articles until each holds 5 % of the characters; splits keep the dump order."""
    items = list(articles)
    if not items:
        raise QKGeomError("empty corpus: the dump holds no articles with prose")
    total = sum(len(text) for _, text in items)
    target = HELD_OUT_FRACTION * total
    order = sorted(range(len(items)), key=lambda i: _article_key(items[i][0]))
    assign: dict[int, str] = {}
    filled = {"val": 0, "test": 0}
    for i in order:
        split = next((s for s in ("val", "test") if filled[s] < target), "train")
        assign[i] = split
        if split != "train":
            filled[split] += len(items[i][1])
    if len(items) < 3 or "train" not in assign.values():
        raise QKGeomError(f"corpus too small to split by article ({len(items)} articles, "
                          f"{total} characters); use a larger dump")
    return {s: "".join(text for i, (_, text) in enumerate(items) if assign[i] == s) for s in SPLITS}


def wikidump_splits(path: str | Path) -> dict[str, str]:
    """A Wikipedia ``*.xml.bz2`` dump converted and split by article, in memory (fine for
    dump parts, not a whole enwiki)."""
    return split_articles(iter_articles(path))


def sample_splits() -> dict[str, str]:
    """The offline default corpus: the shipped Wikipedia excerpt, converted and split by article."""
    return wikidump_splits(sample_dump_path())


def read_utf8(path: Path) -> str:
    """A UTF-8 file's text (a leading BOM dropped); QKGeomError with the byte offset if not
    UTF-8."""
    try:
        text = read_file(path).decode("utf-8")
    except UnicodeDecodeError as err:
        raise QKGeomError(f"{path}: not valid UTF-8 at byte offset {err.start} ({err.reason}); "
                          "convert it to UTF-8 (e.g. `iconv -t UTF-8`) or remove it") from None
    return text[1:] if text.startswith("\ufeff") else text


def wikitext103_splits(path: str | Path | None = None) -> dict[str, str]:
    """WikiText-103 raw: from a folder with ``wiki.{train,valid,test}.raw``, else from ``datasets``."""
    if path is not None:
        folder = Path(path)
        if not folder.is_dir():
            raise QKGeomError(f"{folder}: WikiText folder not found; pass a folder holding "
                              + ", ".join(WIKITEXT_FILES.values()))
        missing = [name for name in WIKITEXT_FILES.values() if not (folder / name).is_file()]
        if missing:
            raise QKGeomError(f"{folder}: missing {', '.join(missing)}; the folder must hold "
                              "all three WikiText raw files")
        return {split: read_utf8(folder / name) for split, name in WIKITEXT_FILES.items()}
    return {split: "".join(wikitext103_pieces(split)) for split in SPLITS}


def wikitext103_pieces(split: str) -> Iterator[str]:
    """One split of the ``datasets`` copy of WikiText-103 raw, 2000 rows a piece: the one
    loader of ``data prepare`` and ``--text``. Its empty rows are the raw files' blank lines
    (`` \\n``), restored: both routes give the same text byte for byte."""
    try:
        import datasets
    except ImportError:
        raise QKGeomError("WikiText-103 without its wiki.*.raw files needs the `datasets` "
                          "package: pip install 'qkgeom[data]', or pass the raw files") from None
    try:
        rows = datasets.load_dataset(_HF_DATASET, _HF_CONFIG, split=_HF_SPLITS[split])["text"]
    except Exception as err:  # network, hub or cache problems: all user-fixable
        raise QKGeomError(f"could not load {_HF_DATASET} ({_HF_CONFIG}) with datasets: "
                          f"{first_line(err)}; check the network/HF cache or pass the "
                          "wiki.*.raw files") from None
    for start in range(0, len(rows), 2000):
        yield "".join(row if row else " \n" for row in rows[start:start + 2000])


def text_files(path: Path) -> list[Path]:
    """The file itself, or every non-hidden file under a folder, sorted by relative path.
    A link inside the folder is refused in one line: it could pull any file of the machine
    into the corpus (``rglob`` lists linked files)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise QKGeomError(f"{path}: no such file or folder; pass a UTF-8 text file or a "
                          "folder of them")
    visible = [p for p in path.rglob("*")
               if not any(part.startswith(".") for part in p.relative_to(path).parts)]
    linked = sorted(p for p in visible if p.is_symlink())
    if linked:
        raise QKGeomError(f"{linked[0]}: is a symbolic link inside the corpus folder; qkgeom "
                          "reads only the files in the folder: copy the file in, or remove "
                          "the link")
    files = sorted(p for p in visible if p.is_file())
    if not files:
        raise QKGeomError(f"{path}: folder holds no files; add UTF-8 text files to it")
    return files


def _line_start(text: str, pos: int) -> int:
    """First line start at or after ``pos`` (``len(text)`` if there is none)."""
    if pos <= 0 or text[pos - 1] == "\n":
        return pos
    nl = text.find("\n", pos)
    return len(text) if nl == -1 else nl + 1


def text_splits(path: str | Path) -> dict[str, str]:
    """Any UTF-8 file or folder, its files joined in order (each ending in a newline): the
    last 10 % split into val 5 % and test 5 %, the cuts moved to the next line start
    unless the lines are too long for it."""
    root = Path(path)
    parts = [read_utf8(file) for file in text_files(root)]
    text = "".join(t if not t or t.endswith("\n") else t + "\n" for t in parts)
    if not text.strip():
        raise QKGeomError(f"{root}: empty corpus (no text in it); pass a file or folder with text")
    n = len(text)
    a0, b0 = int(n * (1 - 2 * HELD_OUT_FRACTION)), int(n * (1 - HELD_OUT_FRACTION))
    a, b = _line_start(text, a0), _line_start(text, b0)
    if not a < b < n:  # lines too long to snap to: cut mid-line rather than lose a split
        a, b = a0, b0
    splits = {"train": text[:a], "val": text[a:b], "test": text[b:]}
    empty = [s for s, t in splits.items() if not t]
    if empty:
        raise QKGeomError(f"{root}: corpus too small to split ({n} characters gave an empty "
                          f"{'/'.join(empty)} split); use more text")
    return splits


def input_files(source: str, path: str | Path | None) -> list[Path]:
    """Files a prepared dataset was made from (their SHA-256 goes into ``meta.json``)."""
    if source == "sample":
        return [sample_dump_path()]
    if path is None:
        return []
    if source == "wikitext-103":
        return [Path(path) / name for name in WIKITEXT_FILES.values()]
    if source == "text":
        return text_files(Path(path))
    return [Path(path)] if source == "wikidump" else []
