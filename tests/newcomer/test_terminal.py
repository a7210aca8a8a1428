"""Terminal and log output: progress lines when the output is not a terminal, tables that
fit 100 columns without cutting a number, a legend, machine-readable --format."""

from __future__ import annotations

import io
import json
import re

import pandas as pd
import pytest
from rich.cells import cell_len

from .conftest import WIDTH, invoke

PROGRESS = re.compile(r"^train step (\d+)/40 \((\d+) %\)  loss \d+\.\d{3}  .*"
                      r"[\d,]+ tok/s  elapsed \d+:\d\d:\d\d  eta (\d+:\d\d:\d\d|\?)$")


def test_a_log_gets_progress_lines_every_probe(smoke_run) -> None:
    lines = [m for line in smoke_run.stdout.splitlines() if (m := PROGRESS.match(line))]
    # smoke: 40 steps, probe_every 10 -> a line at 10, 20, 30 and the end
    assert [int(m.group(1)) for m in lines] == [10, 20, 30, 40]
    assert [int(m.group(2)) for m in lines] == [25, 50, 75, 100]
    assert "val " in smoke_run.stdout.splitlines()[1]  # the val loss once it is measured


def fits(text: str, width: int = WIDTH) -> None:
    assert "…" not in text, text
    too_wide = [line for line in text.splitlines() if cell_len(line) > width]
    assert not too_wide, too_wide


@pytest.mark.parametrize("columns", [WIDTH, 60])
def test_show_fits_the_width_without_cutting_a_number(smoke_run, columns: int) -> None:
    res = invoke("show", str(smoke_run.path), columns=columns)
    assert res.exit_code == 0, res.output
    fits(res.stdout, columns)
    for number in ("PR_Q w", "PR_K tok", "entropy norm", "ΔPR_K tok@0"):  # every column shown
        assert number in res.stdout
    # the legend: one entry per abbreviation, never broken across lines
    assert "PR = participation ratio (effective dimension)" in res.stdout
    assert "ΔX@N = change since step N" in res.stdout


def test_train_output_fits_100_columns(smoke_run) -> None:
    fits(smoke_run.stdout)
    assert "per-layer Q/K geometry at step 40" in smoke_run.stdout


def test_show_format_json_and_csv(smoke_run) -> None:
    shown = invoke("show", str(smoke_run.path), "--format", "json")
    assert shown.exit_code == 0, shown.output
    doc = json.loads(shown.stdout)  # stdout holds the document and nothing else
    assert doc["step"] == 40 and doc["run"] == str(smoke_run.path)
    assert [row["layer"] for row in doc["layers"]] == [0, 1]
    first = doc["layers"][0]
    assert {"pr_q_weight", "pr_k_token", "attn_entropy", "delta_pr_q_token_since_0"} <= set(first)
    metrics = pd.read_parquet(smoke_run.path / "metrics.parquet")
    want = metrics.query("step == 40 and layer == 0 and head == -1 and metric == 'pr_k_token'")
    assert first["pr_k_token"] == pytest.approx(want["value"].item())
    csv = invoke("show", str(smoke_run.path), "--format", "csv", "--step", "0")
    table = pd.read_csv(io.StringIO(csv.stdout))
    assert list(table["layer"]) == [0, 1] and "pr_q_weight" in table.columns


def test_an_unknown_format_is_one_line(smoke_run, capsys) -> None:
    from qkgeom.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["show", str(smoke_run.path), "--format", "yaml"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().endswith("choose one of table, json, csv")


def _claims_frame():
    text = "Key shrinkage goes with a narrower QK spectrum"
    return pd.DataFrame({
        "claim_id": ["E1.2"] * 2 + ["E2.1"] * 2, "claim": ["PR_K shrinks"] * 2 + [text] * 2,
        "level": ["weight", "token"] * 2,
        "from": ["step 0", "reference, step 120"] * 2,
        "measured": ["18/18 runs", "7/18 runs", "18/18 runs", "16/18 runs"],
        "p_value": [3.81e-06, 0.808, 3.81e-06, 2.29e-05],
        "verdict": ["supported", "not supported", "supported", "supported"]})


@pytest.mark.parametrize("columns", [100, 60])
def test_a_claims_table_names_each_claim_once(columns: int, monkeypatch, capsys) -> None:
    """The claim's text on its group's first row only, a rule between groups; at 100
    columns short texts keep their line; at 60 every cell still shows, wrapped."""
    from qkgeom.ui import render_frame

    monkeypatch.setenv("COLUMNS", str(columns))
    render_frame(_claims_frame(), "claims", group=["claim_id", "claim"])
    out = capsys.readouterr().out
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= columns
    assert out.count("E1.2") == out.count("E2.1") == 1 and out.count("├") == 1
    assert out.count("PR_K") == 1 and out.count("├") == 1
    if columns == 100:
        assert out.count("reference, step 120") == 2 and "narrower QK" in out
    else:  # too narrow to keep texts on one line: they fold, the numbers stay whole
        assert "0.808" in out and out.count("3.81e-06") == 2 and "refer" in out
