"""The CLI details a newcomer trips on (issue 24, point 8): ``reproduce e2`` says where E2
is, plain flags show no ``<bool>``, each ``--format`` help says what that command prints,
the terminal claims table has words for headers, ``show`` never splits off a lone column
with a wrapped title, and the monitor writes nothing beside its ``out=`` folder."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from cli_helpers import in_process
from rich.cells import cell_len

from .conftest import invoke
from .test_cli import commands, help_text


def test_reproduce_e2_says_e2_is_part_of_e1(capsys, tmp_path: Path) -> None:
    code, _, err = in_process(["reproduce", "e2", "--preset", "smoke", "--out",
                               str(tmp_path / "s")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "E2 is part of e1" in err and "choose one of e1, e3, e4" in err
    assert not (tmp_path / "s").exists()
    assert "E2" in help_text("reproduce") and "e4" in help_text("reproduce")


def test_no_flag_shows_a_bool_type_in_any_help() -> None:
    for name in commands():
        text = help_text(*name.split())
        assert "<bool>" not in text, name
    assert "<bool>" not in help_text("sweep") and "<bool>" not in help_text("report")
    assert "--resume" in help_text("train") and "<path>" in help_text("train")  # others kept


def test_each_format_help_says_what_that_command_prints() -> None:
    assert "metric names as keys" in help_text("show")
    for command in (("report",), ("sweep", "status"), ("analyze",)):
        text = help_text(*command)
        assert "--format" in text
        if command != ("analyze",):
            assert "metric names as keys" not in text, command
    assert "claims" in help_text("report").split("--format", 1)[1][:200]
    assert "run" in help_text("sweep", "status").split("--format", 1)[1][:200]


def test_the_terminal_claims_table_has_words_for_headers(capsys) -> None:
    from qkgeom.cli.sweeps import terminal_claims

    claims = pd.DataFrame({
        "claim_id": ["E1.1", "E1.1"], "claim": ["PR_Q expands"] * 2,
        "level": ["weight", "token"], "from": ["step 0"] * 2,
        "measured": ["12/18 runs", "18/18 runs"], "p_value": [0.2, 4e-6],
        "verdict": ["mixed", "supported"], "n": [18, 18], "unit": ["runs"] * 2})
    shown = terminal_claims(claims)
    assert "claim_id" not in shown.columns and "p_value" not in shown.columns
    assert {"id", "claim", "p (sign-flip)", "verdict"} <= set(shown.columns)


def lone_column_table() -> pd.DataFrame:
    """The per-layer table of a monitored run (token metrics and pr_qk w only), as
    ``qkgeom show`` builds it: at 110 columns it needs two tables."""
    cols = ["PR_Q tok", "PR_K tok", "contrast tok", "pr_qk w", "entropy", "ΔPR_Q tok@0",
            "ΔPR_K tok@0", "ΔPR_Q tok@5", "ΔPR_K tok@5"]
    table = pd.DataFrame([[16.306, 16.681, -0.375, 6.384, 3.465, -5.373, -6.320, -5.541,
                           -5.408]] * 6, columns=cols)
    table.index.name = "layer"
    return table


def test_show_splits_columns_evenly_and_never_wraps_a_title(monkeypatch, capsys) -> None:
    from qkgeom.ui import render_layers

    monkeypatch.setenv("COLUMNS", "110")
    render_layers(lone_column_table(), "runs/bert-mon — per-layer Q/K geometry at step 20")
    out = capsys.readouterr().out
    assert max(cell_len(line) for line in out.splitlines()) <= 110
    headers = [line for line in out.splitlines() if line.startswith("┃ layer")]
    assert len(headers) == 2
    per_table = [line.count("┃") - 2 for line in headers]  # columns besides layer
    assert sum(per_table) == 9 and min(per_table) >= 4, per_table
    titles = [line for line in out.splitlines() if "per-layer Q/K geometry" in line]
    assert len(titles) == 2 and all("at step 20" in t for t in titles), out


@pytest.mark.parametrize("width", [60, 80, 100, 110, 140])
def test_show_of_every_width_fits_and_keeps_every_column(smoke_run, width: int) -> None:
    res = invoke("show", str(smoke_run.path), columns=width)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert max(cell_len(line) for line in lines) <= width
    title = f"{smoke_run.path} — per-layer Q/K geometry at step 40 (1/2)"
    if cell_len(title) <= width:  # a title that fits the terminal stays on one line
        assert sum("per-layer Q/K geometry at step 40" in line for line in lines) >= 1
        assert not any(line.strip().startswith("at step") for line in lines), res.stdout


def test_the_monitor_writes_nothing_beside_its_folder(tmp_path: Path) -> None:
    from qkgeom.config import make_config
    from qkgeom.model import GPT
    from qkgeom.monitor import GeometryMonitor

    parent = tmp_path / "trainer-output"
    parent.mkdir()
    (parent / "checkpoint-1").mkdir()  # what a Trainer keeps there
    model = GPT(make_config("smoke").model, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with GeometryMonitor(model, ids, every=1, out=parent / "geom", tensorboard=None,
                         wandb=False) as mon:
        mon.step(1)
        held = sorted(p.name for p in parent.iterdir())
        assert held == ["checkpoint-1", "geom"], held  # the lock lives inside geom/
        with pytest.raises(Exception, match="another process is writing"):
            GeometryMonitor(model, ids, every=1, out=parent / "geom", resume=True,
                            tensorboard=None, wandb=False).start(1)
    assert sorted(p.name for p in parent.iterdir()) == ["checkpoint-1", "geom"]
    again = GeometryMonitor(model, ids, every=1, out=parent / "geom", resume=True,
                            tensorboard=None, wandb=False)
    again.start(2)  # the folder with its lock inside resumes
    again.close()
