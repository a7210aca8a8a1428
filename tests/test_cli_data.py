"""`qkgeom data prepare` through the real CLI: a text corpus, and bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkgeom.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_prepare_text_file(tmp_path: Path) -> None:
    src = tmp_path / "corpus.txt"
    src.write_text("the quick brown fox jumps over the lazy dog\n" * 400, encoding="utf-8")
    res = run("data", "prepare", "--source", "text", "--path", str(src), "--dir",
              str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    assert "vocab 29" in res.stdout  # 27 distinct characters + newline... + unknown id
    assert (tmp_path / "out" / "meta.json").is_file()


def test_prepare_wikitext_raw_folder(tmp_path: Path, wikitext_raw: Path) -> None:
    """The shipped excerpt of the real WikiText raw files, laid out as WikiText-103."""
    raw = tmp_path / "raw"
    raw.mkdir()
    valid = (wikitext_raw / "wiki.valid.raw").read_bytes()
    test = (wikitext_raw / "wiki.test.raw").read_bytes()
    (raw / "wiki.train.raw").write_bytes(valid)
    (raw / "wiki.valid.raw").write_bytes(valid)
    (raw / "wiki.test.raw").write_bytes(test)
    res = run("data", "prepare", "--source", "wikitext-103", "--path", str(raw), "--dir",
              str(tmp_path / "wt"))
    assert res.returncode == 0, res.stderr
    # Tokens are characters, not bytes: 36,862 in the valid excerpt's 36,943 bytes.
    n_valid, n_test = len(valid.decode("utf-8")), len(test.decode("utf-8"))
    assert n_valid == 36_862 and n_test == 30_097
    assert f"vocab 95, tokens train {n_valid:,}, val {n_valid:,}, test {n_test:,}" in res.stdout


def test_prepare_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    missing = run("data", "prepare", "--source", "text", "--path", str(tmp_path / "nope.txt"),
                  "--dir", str(tmp_path / "o1"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "nope.txt" in missing.stderr
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 100)
    res = run("data", "prepare", "--source", "text", "--path", str(bad), "--dir",
              str(tmp_path / "o2"))
    assert res.returncode == 2 and "UTF-8" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    unknown = run("data", "prepare", "--source", "wikipedia", "--dir", str(tmp_path / "o3"))
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
