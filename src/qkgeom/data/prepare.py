"""Prepare a corpus once into memory-mapped token arrays, and load it back.

Why: training reads random windows of a corpus that can be 540 M characters long; storing
the character ids as flat ``uint8``/``uint16`` files lets every run ``np.memmap`` them, so
memory does not grow with the corpus and preparation (vocabulary, encoding, hashing) is
paid once. ``meta.json`` records the vocabulary and where the data came from, so a run can
say exactly what it trained on, and :func:`load_prepared` refuses a folder whose arrays do
not match it.

Folder layout: ``train.bin``, ``val.bin``, ``test.bin`` (raw little-endian ids, no header)
and ``meta.json``.

Ownership: :func:`prepare_data` writes only into a new or empty folder, or one holding
prepared data of the same source and inputs (preparing again). A folder with other files,
or prepared data of another corpus (runs may have been trained on it), is refused unless
``force``; even then only the prepared files are replaced, never the others. Runs record
the corpus's :attr:`PreparedData.corpus_sha256` and refuse to resume on another corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from qkgeom.data import sources
from qkgeom.data import vocab as _vocab
from qkgeom.data.vocab import CharVocab
from qkgeom.errors import QKGeomError
from qkgeom.io import atomic_write, temp_name_pattern, write_json

__all__ = [
    "FORMAT_VERSION",
    "SOURCES",
    "PreparedData",
    "prepare_data",
    "load_prepared",
    "default_data_dir",
    "ensure_sample_data",
    "load_data",
    "load_vocab",
    "source_splits",
]

FORMAT_VERSION = 1
SOURCES = ("sample", "wikitext-103", "text", "wikidump")
#: The sample cache's raw text (val + test + train), beside its token arrays: what
#: ``--text sample`` reads (:mod:`qkgeom.data.text`).
SAMPLE_TEXT = "sample.txt"
_SPLITS = sources.SPLITS
_META = "meta.json"
_PREPARED_FILES = frozenset({_META, *(f"{s}.bin" for s in _SPLITS)})
_PREPARED_TEMP = temp_name_pattern("|".join(re.escape(n) for n in sorted(_PREPARED_FILES)))


def source_splits(source: str, path: str | Path | None = None) -> dict[str, str]:
    """Raw text of each split for a source name (see :mod:`qkgeom.data.sources`)."""
    if source not in SOURCES:
        raise QKGeomError(f"unknown data source {source!r}; choose one of {', '.join(SOURCES)}")
    if source == "sample":
        if path is not None:
            raise QKGeomError(
                "data source 'sample' takes no --path (use --source wikidump for a dump)"
            )
        return sources.sample_splits()
    if source == "wikitext-103":
        return sources.wikitext103_splits(path)
    if path is None:
        what = (
            "a UTF-8 text file or folder"
            if source == "text"
            else "an enwiki-*-pages-articles*.xml.bz2 dump"
        )
        raise QKGeomError(f"data source {source!r} needs --path to {what}")
    if source == "text":
        return sources.text_splits(path)
    return sources.wikidump_splits(path)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sha256_text(text: str) -> str:
    digest = hashlib.sha256()
    for start in range(0, len(text), _vocab.ENCODE_CHUNK_CHARS):
        digest.update(
            text[start : start + _vocab.ENCODE_CHUNK_CHARS].encode("utf-8", "surrogatepass")
        )
    return digest.hexdigest()


def _write_tokens(path: Path, text: str, vocab: CharVocab) -> int:
    """Encode ``text`` straight into a memmap at ``path`` (atomically); return the unknown count."""
    unknown = 0

    def write(tmp: Path) -> None:
        nonlocal unknown
        arr = np.memmap(tmp, dtype=vocab.dtype, mode="w+", shape=(len(text),))
        vocab.encode(text, out=arr)
        for start in range(0, len(arr), _vocab.ENCODE_CHUNK_CHARS):
            unknown += int(
                np.count_nonzero(arr[start : start + _vocab.ENCODE_CHUNK_CHARS] == vocab.unknown_id)
            )
        arr.flush()
        del arr

    atomic_write(path, write)
    return unknown


def _check_target(out: Path, provenance: dict[str, Any], force: bool) -> None:
    """Refuse to write into ``out`` unless it is new, empty, or prepared data of the same
    ``provenance`` (source, path, inputs); ``force`` lifts the refusal (the caller then
    replaces only the prepared files)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise QKGeomError(f"{out}: exists and is not a folder; pass another --dir")
    foreign = sorted(p.name for p in out.iterdir()
                     if p.name not in _PREPARED_FILES and not _PREPARED_TEMP.fullmatch(p.name))
    if foreign and not force:
        shown = ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        raise QKGeomError(f"{out}: holds files that are not prepared data ({shown}); pass an "
                          "empty or new --dir (--force writes the prepared files beside them, "
                          "never deleting them)")
    try:
        meta = json.loads((out / _META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # no (readable) meta: an interrupted preparation, or only foreign files
    if not isinstance(meta, dict):
        return
    saved = {k: meta.get(k) for k in provenance}
    # Inputs compare by content: the same files under another path (a moved venv or
    # package) are the same corpus.
    if isinstance(saved.get("inputs"), dict):
        saved["inputs"] = sorted(saved["inputs"].values())
    if saved != provenance and not force:
        raise QKGeomError(f"{out}: holds prepared {meta.get('source')!r} data from other inputs "
                          f"({meta.get('path') or 'the built-in copy'}); runs trained on it "
                          "would find their corpus replaced: pass another --dir, or --force to "
                          "replace it")


def prepare_data(source: str, out_dir: str | Path, *, path: str | Path | None = None,
                 force: bool = False) -> Path:
    """Prepare ``source`` into ``out_dir`` (token arrays + ``meta.json``); return ``out_dir``.

    ``source`` is one of :data:`SOURCES`; ``path`` is the WikiText folder (omit it to use
    the ``datasets`` copy), the text file/folder, or the Wikipedia dump. The vocabulary
    comes from the train split only; characters of val/test outside it become the unknown
    id (their count is in ``meta["unknown_tokens"]``). Ids are uint8 when the vocabulary
    (with the unknown id) has at most 256 entries, else uint16. ``out_dir`` must be new,
    empty, or hold prepared data of the same source and inputs, unless ``force`` (see the
    module doc); files that are not prepared data are never deleted.
    """
    return _write_prepared(Path(out_dir), source, path, source_splits(source, path), force)


def _write_prepared(out: Path, source: str, path: str | Path | None, splits: dict[str, str],
                    force: bool = False) -> Path:
    """:func:`prepare_data` once the splits are read."""
    empty = [s for s in _SPLITS if not splits.get(s)]
    if empty:
        where = f" at {path}" if path is not None else ""
        raise QKGeomError(
            f"empty corpus: the {'/'.join(empty)} split of {source!r}{where} holds no text"
        )
    vocab = CharVocab.from_text(splits["train"])
    inputs = {str(p.resolve()): _sha256_file(p) for p in sources.input_files(source, path)}
    _check_target(out, {"source": source, "inputs": sorted(inputs.values()),
                        "path": str(Path(path).resolve()) if path is not None else None}, force)

    out.mkdir(parents=True, exist_ok=True)
    # Remove the old meta first: a crash below leaves a folder load_prepared rejects.
    (out / _META).unlink(missing_ok=True)
    unknown = {s: _write_tokens(out / f"{s}.bin", splits[s], vocab) for s in _SPLITS}
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "source": source,
        "path": str(Path(path).resolve()) if path is not None else None,
        "vocab": vocab.to_json(),
        "dtype": vocab.dtype.name,
        "sizes": {s: len(splits[s]) for s in _SPLITS},
        "unknown_tokens": unknown,
        "text_sha256": {s: _sha256_text(splits[s]) for s in _SPLITS},
        "inputs": inputs,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if source == "wikitext-103" and path is None:
        meta["datasets"] = {"name": sources._HF_DATASET, "config": sources._HF_CONFIG}
    write_json(out / _META, meta)
    return out


@dataclass(frozen=True, eq=False)
class PreparedData:
    """A prepared corpus: vocabulary, provenance and read-only memory-mapped splits."""

    dir: Path
    vocab: CharVocab
    meta: dict[str, Any]
    train: np.memmap
    val: np.memmap
    test: np.memmap

    @property
    def corpus_sha256(self) -> str | None:
        """SHA-256 of the corpus's text, split by split, as ``meta.json`` records it: what
        a run trained on (the vocabulary has its own digest). None for a meta without it."""
        texts = self.meta.get("text_sha256")
        if not isinstance(texts, dict):
            return None
        return hashlib.sha256(json.dumps(texts, sort_keys=True).encode()).hexdigest()

    @property
    def sizes(self) -> dict[str, int]:
        """Tokens per split."""
        return {s: len(getattr(self, s)) for s in _SPLITS}

    def require_block(self, block_size: int) -> None:
        """QKGeomError unless every split holds at least ``block_size + 1`` tokens.

        A training window needs ``block_size`` inputs plus the next-token target.
        """
        short = {s: n for s, n in self.sizes.items() if n < block_size + 1}
        if short:
            detail = ", ".join(f"{s} has {n:,}" for s, n in short.items())
            raise QKGeomError(
                f"{self.dir}: splits too short for block_size {block_size} ({detail} tokens, "
                f"need {block_size + 1}); use a smaller block_size or a larger corpus"
            )


def _fail(file: Path, problem: str) -> QKGeomError:
    return QKGeomError(
        f"{file}: {problem}; re-run `qkgeom data prepare --dir {file.parent}` for the corpus it came from"
    )


def load_prepared(dir: str | Path) -> PreparedData:
    """Open a folder written by :func:`prepare_data`, checking it against its ``meta.json``.

    Missing or unreadable ``meta.json``, an unknown format version, a bad vocabulary, or a
    ``.bin`` whose size does not match the recorded token count all raise QKGeomError
    naming the file.
    """
    folder = Path(dir)
    meta_path = folder / _META
    if not folder.is_dir():
        raise QKGeomError(
            f"{folder}: prepared data folder not found; run `qkgeom data prepare --dir {folder}`"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _fail(
            meta_path, "missing (not a prepared data folder, or preparation was interrupted)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _fail(meta_path, f"unreadable ({type(err).__name__})") from None
    if not isinstance(meta, dict):
        raise _fail(meta_path, "not a JSON object")
    if meta.get("format_version") != FORMAT_VERSION:
        raise _fail(
            meta_path, f"format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    try:
        vocab = CharVocab.from_json(meta.get("vocab"))
    except QKGeomError as err:
        raise _fail(meta_path, str(err)) from None
    if meta.get("dtype") != vocab.dtype.name:
        raise _fail(
            meta_path,
            f"dtype {meta.get('dtype')!r} does not fit the vocabulary ({vocab.dtype.name})",
        )
    sizes = meta.get("sizes")
    if not isinstance(sizes, dict):
        raise _fail(meta_path, "no 'sizes' entry")
    for split in _SPLITS:
        n = sizes.get(split)
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise _fail(meta_path, f"invalid size {n!r} for split {split!r}")
    arrays = {}
    for split in _SPLITS:
        n = sizes[split]
        bin_path = folder / f"{split}.bin"
        if not bin_path.is_file():
            raise _fail(bin_path, "missing")
        actual = bin_path.stat().st_size
        if actual != n * vocab.dtype.itemsize:
            raise _fail(
                bin_path,
                f"{actual:,} bytes but meta.json records {n:,} {vocab.dtype.name} tokens "
                f"({n * vocab.dtype.itemsize:,} bytes)",
            )
        arrays[split] = np.memmap(bin_path, dtype=vocab.dtype, mode="r", shape=(n,))
    return PreparedData(dir=folder, vocab=vocab, meta=meta, **arrays)


def load_data(spec: str | Path = "sample") -> PreparedData:
    """The prepared corpus ``spec`` names: a prepared folder, or ``"sample"`` for the
    embedded Wikipedia sample (prepared on first use into :func:`default_data_dir`)."""
    return load_prepared(ensure_sample_data() if str(spec) in ("sample", "")
                         else Path(spec))


def load_vocab(data_dir: str | Path) -> CharVocab:
    """The character vocabulary recorded in a prepared folder's ``meta.json``."""
    path = Path(data_dir) / _META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise QKGeomError(f"{path}: the prepared data (its character vocabulary) is missing; "
                          "prepare it again with `qkgeom data prepare`") from None
    return CharVocab.from_json(meta.get("vocab") if isinstance(meta, dict) else None)


def default_data_dir() -> Path:
    """Where the sample corpus is cached: ``$QKGEOM_CACHE/data/sample`` or ``~/.cache/qkgeom/data/sample``."""
    root = os.environ.get("QKGEOM_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "qkgeom"
    return base / "data" / "sample"


def _ready_sample(folder: Path) -> bool:
    try:
        return load_prepared(folder).meta.get("source") == "sample"
    except QKGeomError:
        return False


def _check_replaceable(folder: Path) -> None:
    """Refuse to overwrite a folder that holds anything but (broken) prepared sample data,
    or a symbolic link where the folder should be (dangling or not: never replaced)."""
    if folder.is_symlink():
        raise QKGeomError(f"{folder}: is a symbolic link, not prepared data; remove it (or "
                          "point $QKGEOM_CACHE elsewhere) and run again")
    if not folder.exists():
        return
    if not folder.is_dir():
        raise QKGeomError(f"{folder}: exists and is not a folder; pass another data dir")
    foreign = sorted(p.name for p in folder.iterdir()
                     if p.name not in _PREPARED_FILES and p.name != SAMPLE_TEXT)
    if foreign:
        raise QKGeomError(
            f"{folder}: holds files that are not prepared data ({', '.join(foreign[:3])}); "
            "pass an empty or new folder"
        )
    try:
        source = json.loads((folder / _META).read_text(encoding="utf-8")).get("source")
    except (OSError, ValueError, AttributeError):
        return
    if source not in (None, "sample"):
        raise QKGeomError(
            f"{folder}: holds prepared {source!r} data, not the sample; pass another folder"
        )


def ensure_sample_data(dir: str | Path | None = None) -> Path:
    """Prepare the offline sample corpus into ``dir`` (default :func:`default_data_dir`) once:
    the token arrays, and its raw text as :data:`SAMPLE_TEXT` for models with their own
    tokenizer (the one sample cache: the dump is converted once for both).

    Later calls return at once. Safe when several processes call it together: the first
    takes a lock file next to the folder and prepares into a temp folder that is renamed
    into place (a cache holding only the arrays gets the text added, the arrays left in
    place for the runs reading them); the others wait for the lock and find it ready.
    """
    target = Path(dir) if dir is not None else default_data_dir()
    if _ready_sample(target) and (target / SAMPLE_TEXT).is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        where = " ($QKGEOM_CACHE)" if dir is None and os.environ.get("QKGEOM_CACHE") else ""
        raise QKGeomError(f"{target.parent}: cannot create the data cache folder{where} "
                          f"({err.strerror or type(err).__name__}); set QKGEOM_CACHE to a "
                          "writable folder") from None
    with FileLock(str(target.parent / f".{target.name}.lock")):
        ready = _ready_sample(target)
        if ready and (target / SAMPLE_TEXT).is_file():
            return target
        _check_replaceable(target)
        splits = sources.sample_splits()
        text = splits["val"] + splits["test"] + splits["train"]  # held-out splits first
        if ready:  # arrays cached before the text was kept with them: add it, replace nothing
            atomic_write(target / SAMPLE_TEXT, lambda p: p.write_text(text, encoding="utf-8"))
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            _write_prepared(tmp, "sample", None, splits)
            (tmp / SAMPLE_TEXT).write_text(text, encoding="utf-8")
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target
