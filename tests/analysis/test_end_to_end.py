"""A real tiny sweep trained with the Python API, then collated, tested and reported; and
the rules that the analysis layer never imports torch or the model/trainer, and loads
matplotlib only to draw (bare Figures: no pyplot, no global backend switch)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import qkgeom

ANALYSIS = Path(qkgeom.__file__).parent / "analysis"
ANALYSIS_SOURCES = sorted(ANALYSIS.rglob("*.py"))  # every module, sub-packages and stats too
FORBIDDEN = ("torch", "qkgeom.model", "qkgeom.training", "qkgeom.probe", "qkgeom.geometry",
             "qkgeom.data", "transformers")


@pytest.mark.parametrize("path", ANALYSIS_SOURCES,
                         ids=lambda p: p.relative_to(ANALYSIS).as_posix())
def test_analysis_does_not_import_torch_or_models(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            assert not name.startswith(FORBIDDEN), f"{path.name} imports {name}"


@pytest.mark.parametrize("path", ANALYSIS_SOURCES,
                         ids=lambda p: p.relative_to(ANALYSIS).as_posix())
def test_analysis_never_uses_pyplot_or_switches_the_backend(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert all(a.name != "matplotlib.pyplot" for a in node.names), path.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.module != "matplotlib.pyplot", path.name
            assert not (node.module == "matplotlib"
                        and any(a.name == "pyplot" for a in node.names)), path.name
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            assert not (node.func.attr == "use" and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "matplotlib"), f"{path.name}: matplotlib.use"


def test_importing_the_analysis_and_its_reports_loads_neither_torch_nor_matplotlib():
    code = ("import sys, qkgeom.analysis, qkgeom.analysis.report, qkgeom.analysis.kit, "
            "qkgeom.analysis.figstyle, "
            "qkgeom.analysis.e1.report, qkgeom.analysis.e3.report, qkgeom.analysis.e4.report\n"
            "loaded = [m for m in ('torch', 'matplotlib') if m in sys.modules]\n"
            "assert not loaded, loaded")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
def test_real_tiny_sweep_end_to_end(sample_data: Path, tmp_path: Path):
    from matplotlib import image as plt_image

    from qkgeom import make_config, train
    from qkgeom.analysis import claims_table, collate, trajectories, write_report

    root = tmp_path / "sweep"
    runs = []
    for init, seed in (("normal", 0), ("normal", 1), ("tied", 0)):
        rid = f"n_layer2-qk_init-{init}-seed{seed}"
        axes = {"model.n_layer": 2, "model.qk_init": init, "seed": seed}
        cfg = make_config("smoke", {"data": str(sample_data), "model": {"qk_init": init},
                                    "seed": seed, "steps": 20, "probe_every": 10})
        train(cfg, root / "runs" / rid)
        runs.append({"run_id": rid, "axes": axes})
    (root / "sweep.json").write_text(json.dumps({  # as the sweep runner writes it
        "grid": {"name": "e2e", "preset": "smoke", "base": {"steps": 20},
                 "axes": {"model.n_layer": [2], "model.qk_init": ["normal", "tied"],
                          "seed": [0, 1]}},
        "runs": runs}))

    data = collate(root)
    assert data.metrics["run_id"].nunique() == 3 and data.excluded.empty
    assert set(data.metrics["step"]) == {0, 10, 20}
    tr = trajectories(data, "pr_q_token")
    assert len(tr) == 2 * 2 * 3  # inits x layers x steps
    assert set(tr.loc[tr["qk_init"] == "normal", "n_seeds"]) == {2}

    claims = claims_table(root)
    # 30 rows of the run-level value (E2.1/E2.2 with and without the cross-run null) and
    # one per claim and layer
    assert len(claims) == 30 + 6 * 2
    # 3 runs; from the reference (step 10) E2.1/E2.2 have one probe-to-probe change, too
    # few to rank: no run can be measured there
    assert set(claims["n"]) <= {0, 3}
    assert set(claims.loc[claims["claim_id"].str.startswith("E1"), "n"]) == {3}
    # 3 runs: p >= 1/8 either way, so no row can be supported or not supported
    for r in claims.itertuples():
        expected = ("not evaluated" if r.n == 0 or (isinstance(r.reason, str) and r.reason)
                    else "inconclusive")
        assert r.verdict == expected, r
    # 20 steps: the reference is 25 % of the run (step 5) -> the first probe after it, 10
    mean_rows = claims[claims["layer"].isna()]
    assert set(mean_rows.loc[mean_rows["origin"] == "reference", "from"]) == {
        "reference, step 10"}

    md = write_report(root)
    text = md.read_text(encoding="utf-8")
    assert text.splitlines()[2].startswith("> **E1/E2: ")  # the summary line
    # 3 runs: too few for any verdict, said in one line; the table has no verdict column
    assert text.splitlines()[4].startswith("**Descriptive: 3 runs. A verdict needs at least 5")
    assert text.splitlines()[6].startswith("| claim / level |")
    assert "verdict" not in text.splitlines()[6]
    assert "e2e" in text.splitlines()[0]
    image = plt_image.imread(md.parent / "pr_token.png")  # a real figure with curves on it
    assert image.shape[0] > 200 and len(np.unique(image.reshape(-1, image.shape[-1]),
                                                  axis=0)) > 20
    page = (md.parent / "report.html").read_text(encoding="utf-8")
    assert "<table" in page and ('src="data:image/png;base64,' in page
                                 or 'src="pr_token.png"' in page)
