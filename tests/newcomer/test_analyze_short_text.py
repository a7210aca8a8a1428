"""``qkgeom analyze`` of a short text (issue 24, point 2): a user asking for few tokens gets
an analysis in fewer token blocks, said in one line, not a refusal caused by the
bootstrap's default of 8 blocks."""

from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd
import pytest
from cli_helpers import in_process


def test_fitting_blocks() -> None:
    from qkgeom.checkpoints.analyze import fitting_blocks

    assert fitting_blocks(20, 8) == 8
    assert fitting_blocks(6, 8) == 6  # the 3 000 tokens in windows of 512
    assert fitting_blocks(1, 8) == 1 and fitting_blocks(0, 8) == 1
    assert fitting_blocks(5, 1) == 1


def analyze(capsys, run: Path, out: Path, tokens: int) -> tuple[int, str, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, stdout, _ = in_process(["analyze", str(run), "--text", "sample", "--tokens",
                                      str(tokens), "--out", str(out), "--quiet"], capsys)
    return code, stdout, [str(w.message) for w in caught if "token blocks" in str(w.message)]


@pytest.mark.slow
def test_a_short_text_is_analysed_in_fewer_blocks(smoke_run, sample_cache: Path, capsys,
                                                 tmp_path: Path) -> None:
    # the smoke model's context is 32: 100 tokens are 4 windows, fewer than 8 blocks
    code, stdout, said = analyze(capsys, smoke_run.path, tmp_path / "short", 100)
    assert code == 0, stdout
    assert len(said) == 1 and "\n" not in said[0], said  # one line for the whole family
    assert said[0] == ("the text gave 100 tokens, windows of up to 32: too few for the 8 "
                       "token blocks asked for (--blocks); measured in 4 blocks instead")
    ckpts = pd.read_parquet(tmp_path / "short" / "checkpoints.parquet")
    assert set(ckpts["blocks"]) == {4} and len(ckpts) >= 2
    metrics = pd.read_parquet(tmp_path / "short" / "metrics.parquet")
    assert sorted(metrics["block"].unique()) == [-1, 0, 1, 2, 3]
    # one window: no blocks at all, still an analysis
    code, _, said = analyze(capsys, smoke_run.path, tmp_path / "one", 20)
    assert code == 0 and len(said) == 1 and "without token blocks" in said[0]
    assert set(pd.read_parquet(tmp_path / "one" / "metrics.parquet")["block"]) == {-1}
