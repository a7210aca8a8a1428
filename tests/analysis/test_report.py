"""Figures and the report on a synthetic sweep (written once per module: figures are slow)."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

from qkgeom.analysis import collate, write_report
from qkgeom.analysis.e1.figures import FIGURES, fig_contrast
from qkgeom.analysis.figstyle import save_figure

from .conftest import monotone_values, write_run
from .e1_sweeps import distinct_sweep


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rep") / "sweep"
    distinct_sweep(root, depths=(3,), inits=("normal", "tied"), seeds=(0, 1, 2, 3),
                   n_head=2)  # 8 runs: 8/8 has p = 1/256, Holm 6/256 < 0.05
    write_run(root, "n_layer3-qk_init-tied-seed7", 3, "tied", 7, monotone_values(),
              state="failed")
    return write_report(root)


def assert_figure(png: Path) -> None:
    """A real PNG (it decodes) with something drawn on it, and its SVG twin parses."""
    import xml.etree.ElementTree as ET

    import numpy as np
    from matplotlib import image as plt_image

    image = plt_image.imread(png)
    assert image.shape[0] > 200 and image.shape[1] > 200, png
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 20, png
    assert ET.parse(png.with_suffix(".svg")).getroot().tag.endswith("svg")


def test_report_files(report):
    out = report.parent
    assert report.name == "report.md" and out.name == "report"
    for kind in FIGURES:
        for level in ("weight", "token"):
            assert_figure(out / f"{kind}_{level}.png")
    claims = pd.read_csv(out / "claims.csv")
    primary = claims[claims["role"] == "primary"]
    # 30 rows of the run-level value (E2.1/E2.2 with and without the null) + 6 x 3 layers
    assert len(claims) == 48 and len(primary) == 6
    assert (primary["verdict"] == "supported").all()
    assert (claims["n"] == 8).all() and (claims["k"] == 8).all()
    assert list(claims["layer"].dropna().unique()) == [0, 1, 2]
    sens = pd.read_csv(out / "reference_sensitivity.csv")  # probes at 10 %, ..., 70 %
    assert sorted(sens["reference_step"].unique()) == [10, 20, 30, 40, 50, 60, 70]
    assert sens.loc[sens["primary"], "reference_step"].unique().tolist() == [30]
    assert len(pd.read_csv(out / "reference_sensitivity_runs.csv")) == 8 * 7 * 2
    assert_figure(out / "per_layer.png")
    assert_figure(out / "reference_sensitivity.png")
    assert not (out / "ladder_trend.csv").exists()  # one width: no ladder
    readings = pd.read_csv(out / "contrast_readings.csv")
    assert set(readings["reading"]) == {"a", "b", "c", "d"}
    cells = pd.read_csv(out / "cell_stats.csv")
    assert set(cells["qk_init"]) == {"normal", "tied"}  # 2 depth x init cells
    for name in ("trajectory_stats.csv", "trajectory_stats_runs.csv"):
        assert len(pd.read_csv(out / name)) > 0, name
    assert not (out / "bootstrap.csv").exists()
    runs = pd.read_csv(out / "run_stats.csv")
    assert runs["run_id"].nunique() == 8 and (runs["n_layers"] == 3).all()
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temp files


def test_report_md_opens_with_the_summary_and_the_claims_table(report):
    lines = report.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("# qkgeom report")
    first = next(line for line in lines[1:] if line.strip())
    assert first == ("> **E1/E2: 6 of 6 claims supported (primary rows; 42 secondary rows "
                     "below)**")
    assert lines[4].startswith("| claim / level | row | measured from | units with the sign")
    groups = [line for line in lines[5:45] if " · **" in line]
    ids = [g.split(" · ")[0][2:] for g in groups]
    assert ids == ["E1.1", "E1.2", "E1.3", "E2.1", "E2.2", "E2.3"]
    table = [line for line in lines[5:45] if line.startswith(("| weight", "| token"))]
    assert len(table) == 30
    assert all("8/8 runs" in line for line in table)
    assert sum("**supported**" in line for line in table) >= 6
    assert any("reference, step 30" in line for line in table)
    text = report.read_text(encoding="utf-8")
    assert text.index("## E1.3 read four ways") < text.index("## Setup")
    assert "| **(c)** |" in text
    assert text.index("## Per layer") < text.index("## Reference sensitivity") \
        < text.index("## E1.3 read four ways")
    per_layer = text.split("## Per layer", 1)[1].split("##", 1)[0]
    assert "| E1.2 | 0 | 8/8 runs |" in per_layer
    assert "| **30** (primary) | 30% |" in text


def test_report_lists_excluded_run_and_setup(report):
    text = report.read_text(encoding="utf-8")
    excluded = text.split("## Excluded runs", 1)[1].split("##", 1)[0]
    assert "n_layer3-qk_init-tied-seed7" in excluded and "failed" in excluded
    setup = text.split("## Setup", 1)[1].split("## Excluded", 1)[0]
    assert "6,400 tokens per run" in setup  # 100 steps x 4 x 16
    assert "9 runs, 8 analysed, 1 excluded" in setup
    assert "Training time" in setup and "summed over 8 runs" in setup and "seeds" in setup
    assert "Wall time" not in setup  # (their status.json records no start: no wall-clock)


def test_html_shows_every_figure(report):
    page = (report.parent / "report.html").read_text(encoding="utf-8")
    assert "<table>" in page
    shown = re.findall(r'<img [^>]*src="(data:image/png;base64,|[a-z_]+\.png")', page)
    # embedded when small, else from its file; + per layer and reference sensitivity
    assert len(shown) == 2 * len(FIGURES) + 2


def test_single_run_figure_and_missing_init_panel(tmp_path):
    """A sweep where one depth lacks an init still draws (an empty 'no runs' panel)."""
    root = tmp_path / "gap"
    write_run(root, "a", 2, "normal", 0, monotone_values())
    write_run(root, "b", 3, "tied", 0, monotone_values())
    paths = save_figure(fig_contrast(collate(root).metrics, "token"), tmp_path / "figs", "c")
    assert [p.suffix for p in paths] == [".png", ".svg"]
    assert_figure(paths[0])


def test_report_without_any_finished_run(tmp_path):
    root = tmp_path / "dead"
    write_run(root, "a", 2, "normal", 0, monotone_values(), state="diverged")
    md = write_report(root)
    text = md.read_text(encoding="utf-8")
    assert "not evaluated" in text and "diverged at step" in text
    assert "No figures" in text
