"""`qkgeom data prepare` through the real CLI: a text corpus (in a subprocess), and bad
input (through the same entry point in-process: exit code and one line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import in_process


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


def test_prepare_bad_input_is_one_line_exit_2(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = in_process(["data", "prepare", "--source", "text", "--path",
                               str(tmp_path / "nope.txt"), "--dir", str(tmp_path / "o1")], capsys)
    assert code == 2 and "Traceback" not in err and "nope.txt" in err
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 100)
    code, _, err = in_process(["data", "prepare", "--source", "text", "--path", str(bad),
                               "--dir", str(tmp_path / "o2")], capsys)
    assert code == 2 and "UTF-8" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = in_process(["data", "prepare", "--source", "wikipedia", "--dir",
                               str(tmp_path / "o3")], capsys)
    assert code == 2 and "Traceback" not in err
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))
