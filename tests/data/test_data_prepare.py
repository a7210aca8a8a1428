"""prepare_data / load_prepared on real WikiText files, the datasets route and plain text."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from qkgeom.data import CharVocab, load_prepared, prepare_data
from qkgeom.errors import QKGeomError

#: sha256 of the shipped excerpts, as listed in tests/data/wikitext-raw/README.md.
VALID_SHA256 = "aefbb9955e3faa377db66bf2422ec6a91458b91291e619e7c368b735a522ae33"
TEST_SHA256 = "39d4fddb02eeee1b41c458941114f32ce32a3cd2b8bc9850c0eb7eb8b70e0b38"


@pytest.fixture(scope="module")
def wikitext_dir(wikitext_raw: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real raw files laid out as WikiText-103: valid doubles as train."""
    folder = tmp_path_factory.mktemp("wikitext")
    shutil.copy(wikitext_raw / "wiki.valid.raw", folder / "wiki.train.raw")
    shutil.copy(wikitext_raw / "wiki.valid.raw", folder / "wiki.valid.raw")
    shutil.copy(wikitext_raw / "wiki.test.raw", folder / "wiki.test.raw")
    return folder


def test_shipped_excerpt_is_real_wikitext_format(wikitext_raw: Path):
    """The excerpt keeps the real raw format: whole articles, headings, @-@ tokens, LF only."""
    readme = (wikitext_raw / "README.md").read_text(encoding="utf-8")
    titles = {
        "wiki.valid.raw": ["Homarus gammarus", "Frank Headlam", "M @-@ 82 ( Michigan highway )",
                           "Shikamaru Nara"],
        "wiki.test.raw": ["Robert Boulter", "Du Fu"],
    }
    for name, sha in (("wiki.valid.raw", VALID_SHA256), ("wiki.test.raw", TEST_SHA256)):
        raw = (wikitext_raw / name).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == sha and sha in readme
        assert f"{len(raw):,}" in readme
        assert b"\r" not in raw
        text = raw.decode("utf-8")
        # Every article opens with a blank line (" ") and a " = Title = " line; the
        # excerpt stops at an article boundary, so it ends with a paragraph and a blank line.
        assert re.findall(r"^ = ([^=].*) = $", text, flags=re.M) == titles[name]
        assert text.startswith(f" \n = {titles[name][0]} = \n \n ")
        for title in titles[name][1:]:
            assert f" \n \n = {title} = \n \n " in text
        assert text.endswith(" . \n \n")
        assert re.search(r"^ = = [^=].* = = $", text, flags=re.M)  # section headings
        assert " @-@ " in text and " @.@ " in text  # WikiText's split hyphens and decimals
        # The raw splits keep every word: <unk> only appears in the tokenised (non-raw) files.
        assert "<unk>" not in text


@pytest.fixture(scope="module")
def wikitext_prepared(wikitext_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_data("wikitext-103", tmp_path_factory.mktemp("wt-prepared"), path=wikitext_dir)


def test_wikitext_files(wikitext_dir: Path, wikitext_prepared: Path):
    train = (wikitext_dir / "wiki.train.raw").read_text(encoding="utf-8")
    test = (wikitext_dir / "wiki.test.raw").read_text(encoding="utf-8")
    data = load_prepared(wikitext_prepared)
    vocab = data.vocab
    assert vocab.chars == "".join(sorted(set(train)))
    # The shipped valid excerpt has 94 distinct characters: 95 ids fit uint8 (the whole
    # valid split has 284, which needs uint16: see test_text_over_256_ids_is_uint16).
    assert vocab.vocab_size == len(set(train)) + 1 == 95
    assert data.train.dtype == np.uint8 and data.meta["dtype"] == "uint8"
    assert data.sizes == {"train": len(train), "val": len(train), "test": len(test)}
    assert len(train) < len(train.encode("utf-8"))  # multi-byte characters (e.g. "–")
    assert (wikitext_prepared / "train.bin").stat().st_size == len(train)
    assert isinstance(data.train, np.memmap) and not data.train.flags.writeable
    assert vocab.decode(data.train[:1000]) == train[:1000]
    assert np.array_equal(data.val, data.train)
    # Characters of test never seen in train map to the unknown id, and only those.
    unseen = set(test) - set(train)
    assert unseen, "the real test excerpt has characters the valid excerpt lacks"
    is_unseen = np.array([c in unseen for c in test])
    assert np.array_equal(np.asarray(data.test) == vocab.unknown_id, is_unseen)
    assert data.meta["unknown_tokens"] == {"train": 0, "val": 0, "test": int(is_unseen.sum())}
    known = ~is_unseen
    assert "".join(np.array(list(test))[known]) == vocab.decode(np.asarray(data.test)[known])


def test_wikitext_meta_provenance(wikitext_dir: Path, wikitext_prepared: Path):
    meta = json.loads((wikitext_prepared / "meta.json").read_text())
    assert meta["source"] == "wikitext-103" and meta["format_version"] == 1
    assert meta["path"] == str(wikitext_dir.resolve())
    # sha256 of the shipped excerpts, as published in their README.
    assert meta["inputs"][str(wikitext_dir / "wiki.valid.raw")] == VALID_SHA256
    assert meta["inputs"][str(wikitext_dir / "wiki.test.raw")] == TEST_SHA256
    assert CharVocab.from_json(meta["vocab"]).vocab_size == 95


HUB_README = """---
configs:
- config_name: wikitext-103-raw-v1
  data_files:
  - split: train
    path: wikitext-103-raw-v1/train-*
  - split: validation
    path: wikitext-103-raw-v1/validation-*
  - split: test
    path: wikitext-103-raw-v1/test-*
---
"""


@pytest.fixture
def local_hub_copy(wikitext_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local copy of the hub repository ``Salesforce/wikitext`` as it is laid out there (a
    README whose YAML names the configs, one Parquet file per split, one row per raw line,
    blank lines stored as ""), in the working directory: the real ``datasets.load_dataset``
    opens a local folder of that name instead of the hub. Offline, with its own cache."""
    datasets = pytest.importorskip("datasets")
    import pandas as pd

    repo = tmp_path / "hub" / "Salesforce" / "wikitext"
    files = repo / "wikitext-103-raw-v1"
    files.mkdir(parents=True)
    (repo / "README.md").write_text(HUB_README, encoding="utf-8")
    for split, raw in (("train", "wiki.train.raw"), ("validation", "wiki.valid.raw"),
                       ("test", "wiki.test.raw")):
        lines = (wikitext_dir / raw).read_text(encoding="utf-8").splitlines(keepends=True)
        rows = [line if line.strip() else "" for line in lines]
        pd.DataFrame({"text": rows}).to_parquet(files / f"{split}-00000-of-00001.parquet")
    monkeypatch.chdir(tmp_path / "hub")
    # read by datasets when it is imported: set on its config module
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return repo


def test_datasets_route_matches_raw_files(wikitext_prepared, local_hub_copy, tmp_path):
    """``--source wikitext-103`` without a folder goes through ``datasets.load_dataset``
    (really called, on the local copy of the hub layout) and gives the raw files' data
    byte for byte (the blank rows restored)."""
    out = prepare_data("wikitext-103", tmp_path / "hf")
    assert list((tmp_path / "hf-cache").iterdir())  # datasets really built its cache
    ref = json.loads((wikitext_prepared / "meta.json").read_text())
    got = json.loads((out / "meta.json").read_text())
    for key in ("vocab", "dtype", "sizes", "unknown_tokens", "text_sha256"):
        assert got[key] == ref[key], key
    assert got["path"] is None and got["datasets"]["name"] == "Salesforce/wikitext"
    for split in ("train", "val", "test"):
        assert (out / f"{split}.bin").read_bytes() == (
            wikitext_prepared / f"{split}.bin"
        ).read_bytes()


def test_analysis_text_through_datasets_is_the_raw_split(wikitext_dir, local_hub_copy):
    """``--text wikitext-103:test`` (the checkpoint analysis's text) reads the same split
    through the real loader: the raw file's text, blank lines restored."""
    from qkgeom.data.text import open_text

    text = "".join(open_text("wikitext-103:test")())
    assert text == (wikitext_dir / "wiki.test.raw").read_text(encoding="utf-8")


def test_datasets_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(QKGeomError, match=r"pip install 'qkgeom\[data\]'"):
        prepare_data("wikitext-103", tmp_path / "x")


def test_datasets_load_failure_is_one_line(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("no network\nsecond line")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(QKGeomError, match="ConnectionError: no network;") as err:
        prepare_data("wikitext-103", tmp_path / "x")
    assert "\n" not in str(err.value)


def test_wikitext_folder_missing_files(tmp_path):
    with pytest.raises(QKGeomError, match="WikiText folder not found"):
        prepare_data("wikitext-103", tmp_path / "out", path=tmp_path / "nowhere")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / "wiki.train.raw").write_text("x\n")
    with pytest.raises(QKGeomError, match="missing wiki.valid.raw, wiki.test.raw"):
        prepare_data("wikitext-103", tmp_path / "out", path=tmp_path / "wt")


# --- plain text ------------------------------------------------------------------------


def _lines(n: int, prefix: str = "line") -> str:
    return "".join(f"{prefix} {i:04d} of the corpus\n" for i in range(n))


def test_text_file_split_tail(tmp_path):
    text = _lines(200)
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    data = load_prepared(prepare_data("text", tmp_path / "out", path=tmp_path / "corpus.txt"))
    assert data.train.dtype == np.uint8  # ASCII: well under 256 ids
    decoded = {s: data.vocab.decode(getattr(data, s)) for s in ("train", "val", "test")}
    assert decoded["train"] + decoded["val"] + decoded["test"] == text
    # 90/5/5 by characters, cut at line starts.
    line = len(text) // 200
    assert data.sizes == {"train": 180 * line, "val": 10 * line, "test": 10 * line}
    assert decoded["val"].startswith("line 0180") and decoded["test"].startswith("line 0190")


def test_text_folder_sorted_and_joined(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "b").mkdir(parents=True)
    (folder / "b" / "2.txt").write_text(_lines(100, "bee"), encoding="utf-8")
    (folder / "a.txt").write_text("no trailing newline", encoding="utf-8")
    (folder / ".hidden").write_text("\xff never read", encoding="latin-1")
    data = load_prepared(prepare_data("text", tmp_path / "out", path=folder))
    full = "".join(data.vocab.decode(getattr(data, s)) for s in ("train", "val", "test"))
    assert full == "no trailing newline\n" + _lines(100, "bee")
    assert data.meta["inputs"] == {
        str((folder / "a.txt").resolve()): data.meta["inputs"][str((folder / "a.txt").resolve())],
        str((folder / "b" / "2.txt").resolve()): data.meta["inputs"][
            str((folder / "b" / "2.txt").resolve())
        ],
    }


def test_text_over_256_ids_is_uint16(tmp_path):
    chars = "".join(chr(0x100 + i) for i in range(300))  # 300 characters + unknown: uint16
    text = "".join(f"{chars[i:] + chars[:i]}\n" for i in range(40))
    (tmp_path / "wide.txt").write_text(text, encoding="utf-8")
    data = load_prepared(prepare_data("text", tmp_path / "out", path=tmp_path / "wide.txt"))
    assert data.vocab.vocab_size == 302 and data.meta["dtype"] == "uint16"
    assert data.train.dtype == np.uint16
    assert (tmp_path / "out" / "train.bin").stat().st_size == 2 * data.sizes["train"]
    decoded = "".join(data.vocab.decode(getattr(data, s)) for s in ("train", "val", "test"))
    assert decoded == text


def test_unseen_chars_in_text_val_are_unknown(tmp_path):
    text = _lines(180) + _lines(20, "ÆØÅÆ")  # the tail (val/test) holds new characters
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    data = load_prepared(prepare_data("text", tmp_path / "out", path=tmp_path / "c.txt"))
    assert "Æ" not in data.vocab.chars
    assert (
        int((np.asarray(data.test) == data.vocab.unknown_id).sum())
        == data.meta["unknown_tokens"]["test"]
        > 0
    )
    assert data.vocab.decode(data.val[:6]) == "\ufffd\ufffd\ufffd\ufffd 0"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing.txt", r"missing\.txt: no such file or folder"),
        (
            lambda p: (p / "bad.txt").write_bytes(b"ok line\nsecond \xff line\n") and p / "bad.txt",
            r"bad\.txt: not valid UTF-8 at byte offset 15",
        ),
        (
            lambda p: (p / "empty.txt").write_text("") is not None and p / "empty.txt",
            r"empty\.txt: empty corpus",
        ),
        (lambda p: (p / "blank.txt").write_text(" \n\n") and p / "blank.txt", "empty corpus"),
        (lambda p: (p / "emptydir").mkdir() or p / "emptydir", r"emptydir: folder holds no files"),
        (lambda p: (p / "tiny.txt").write_text("ab") and p / "tiny.txt", "too small to split"),
    ],
)
def test_text_errors(tmp_path, make, message):
    with pytest.raises(QKGeomError, match=message) as err:
        prepare_data("text", tmp_path / "out", path=make(tmp_path))
    assert "\n" not in str(err.value)


def test_source_errors(tmp_path):
    with pytest.raises(QKGeomError, match="unknown data source 'wikitext-2'; choose one of sample"):
        prepare_data("wikitext-2", tmp_path)
    with pytest.raises(QKGeomError, match="needs --path"):
        prepare_data("text", tmp_path)
    with pytest.raises(QKGeomError, match="needs --path"):
        prepare_data("wikidump", tmp_path)
    with pytest.raises(QKGeomError, match="'sample' takes no --path"):
        prepare_data("sample", tmp_path, path=tmp_path)


def test_require_block(tmp_path):
    (tmp_path / "c.txt").write_text(_lines(200), encoding="utf-8")
    data = load_prepared(prepare_data("text", tmp_path / "out", path=tmp_path / "c.txt"))
    n_val = data.sizes["val"]
    data.require_block(n_val - 1)  # val has exactly block_size + 1 tokens: fine
    with pytest.raises(QKGeomError, match=rf"too short for block_size {n_val}.*val has {n_val:,}"):
        data.require_block(n_val)


# --- meta corruption ---------------------------------------------------------------------


@pytest.fixture
def prepared_text(tmp_path) -> Path:
    (tmp_path / "c.txt").write_text(_lines(100), encoding="utf-8")
    return prepare_data("text", tmp_path / "out", path=tmp_path / "c.txt")


def _edit_meta(folder: Path, **changes) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    meta.update(changes)
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda d: (d / "meta.json").unlink(), r"meta\.json: missing"),
        (lambda d: (d / "meta.json").write_text("{not json"), r"meta\.json: unreadable"),
        (lambda d: (d / "meta.json").write_text("[1, 2]"), r"meta\.json: not a JSON object"),
        (lambda d: _edit_meta(d, format_version=99), "format_version 99"),
        (lambda d: _edit_meta(d, vocab={"chars": "ba"}), "sorted"),
        (lambda d: _edit_meta(d, dtype="uint16"), "does not fit the vocabulary"),
        (
            lambda d: _edit_meta(d, sizes={"train": 5, "val": 5}),
            "invalid size None for split 'test'",
        ),
        (lambda d: (d / "val.bin").unlink(), r"val\.bin: missing"),
        (
            lambda d: (d / "train.bin").write_bytes((d / "train.bin").read_bytes()[:-3]),
            r"train\.bin: .* bytes but",
        ),
    ],
)
def test_load_prepared_detects_corruption(prepared_text, corrupt, message):
    load_prepared(prepared_text)  # fine before
    corrupt(prepared_text)
    with pytest.raises(QKGeomError, match=message) as err:
        load_prepared(prepared_text)
    assert "qkgeom data prepare" in str(err.value) and "\n" not in str(err.value)


def test_load_prepared_missing_folder(tmp_path):
    with pytest.raises(QKGeomError, match="prepared data folder not found"):
        load_prepared(tmp_path / "nothing")


def test_reprepare_overwrites(prepared_text, tmp_path):
    (tmp_path / "d.txt").write_text(_lines(300, "other"), encoding="utf-8")
    with pytest.raises(QKGeomError, match="other inputs.*--force"):  # another corpus
        prepare_data("text", prepared_text, path=tmp_path / "d.txt")
    data = load_prepared(prepare_data("text", prepared_text, path=tmp_path / "d.txt",
                                      force=True))
    assert data.vocab.decode(data.train[:10]) == "other 0000"
    assert sorted(p.name for p in prepared_text.iterdir()) == [
        "meta.json",
        "test.bin",
        "train.bin",
        "val.bin",
    ]
