"""The report figures as a newcomer looks at them (issue 24, point 7): every text inside
the figure (titles wrapped to its width, never clipped), layer colours that never reuse
the colour of the legend's PR_Q/PR_K keys, ρ in each heads panel over shared axes, and
text readable when the page is 800 px wide. Built from in-memory tables of the sizes the
presets give (E1 demo: 3 depths × 3 inits, depth 8; E3 demo: 5 controlled arms; E4:
a 4-layer family), so every layout a newcomer meets is checked without training."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("matplotlib", reason="figures need qkgeom[report]")

import matplotlib  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from qkgeom.analysis.collate import COLUMNS  # noqa: E402
from qkgeom.analysis.figstyle import SCREEN_DPI, STYLE, layer_colors, save_figure  # noqa: E402

#: What an 800-px-wide window leaves a figure in report.html (body padding, scrollbar).
PAGE_PX = 750
#: The smallest text, in CSS pixels of its em, that reads without zooming.
READABLE_PX = 9.5

STEPS = list(range(0, 401, 40))


def _long(rows: list[tuple]) -> pd.DataFrame:
    frame = pd.DataFrame(rows, columns=["run_id", "depth", "qk_init", "variant", "seed",
                                        "state", "step", "layer", "head", "metric", "value"])
    return frame[COLUMNS]


def e1_table(depths=(4, 6, 8), inits=("normal", "orthogonal", "tied"), seeds=(0, 1),
             heads: int = 4) -> pd.DataFrame:
    """A collated E1 table: PR_Q rising, PR_K falling per layer; pr_qk and entropy per
    head at every probe (heads ordered so that ρ across heads is known)."""
    rng = np.random.default_rng(0)
    rows, records = [], []
    for depth in depths:
        for init in inits:
            for seed in seeds:
                rid = f"n_layer={depth},qk_init={init},seed={seed}"
                for step in STEPS:
                    for layer in range(depth):
                        for level in ("weight", "token"):
                            q = 10 + 0.01 * step + layer + rng.normal(0, 0.1)
                            k = 9 - 0.01 * step + 0.5 * layer + rng.normal(0, 0.1)
                            for metric, v in ((f"pr_q_{level}", q), (f"pr_k_{level}", k),
                                              (f"contrast_{level}", q - k),
                                              (f"pr_qk_{level}", k / 2)):
                                rows.append((rid, depth, init, "", seed, "done", step, layer,
                                             -1, metric, v))
                            for h in range(heads):
                                rows.append((rid, depth, init, "", seed, "done", step, layer,
                                             h, f"pr_qk_{level}", 2 + h + rng.normal(0, .1)))
                        rows.append((rid, depth, init, "", seed, "done", step, layer, -1,
                                     "attn_entropy", 1 + 0.001 * step))
                        for h in range(heads):
                            rows.append((rid, depth, init, "", seed, "done", step, layer, h,
                                         "attn_entropy", 1 + 0.1 * h + rng.normal(0, .05)))
                records.append({"run_id": rid, "depth": depth, "qk_init": init, "variant": "",
                                "seed": seed, "state": "done", "steps": STEPS[-1],
                                "ref_step": 100, "excluded": ""})
    table = _long(rows)
    table.attrs.update(runs=records, excluded=[], sweep={}, name="e1-demo-like")
    return table


def e3_frames(arms=("sham-data", "hold-data", "shrink-0.5-data", "hold-frobenius",
                    "shrink-0.5-frobenius"), seeds=range(5)) -> tuple[pd.DataFrame, ...]:
    from qkgeom.analysis.e3.figures import PAIRED_QUANTITIES, TRAJ_QUANTITIES

    rng = np.random.default_rng(1)
    series, paired = [], []
    for arm in ("none", *arms):
        for seed in seeds:
            for q in TRAJ_QUANTITIES:
                for step in STEPS[1:]:
                    series.append((arm, q, f"seed={seed},arm={arm}", step, 1 + rng.normal()))
            if arm == "none":
                continue
            for q in PAIRED_QUANTITIES:
                for step in STEPS[1:]:
                    paired.append(("none", arm, q, seed, step, rng.normal(0, 0.1)))
    return (pd.DataFrame(series, columns=["arm", "quantity", "run_id", "step", "value"]),
            pd.DataFrame(paired, columns=["baseline", "arm", "quantity", "group", "step",
                                          "diff"]))


def e4_tables(tmp_path: Path) -> dict:
    """An analysis folder of a 4-layer family at 7 log-spaced steps, through
    :func:`qkgeom.analysis.e4.report.load_analysis`."""
    from qkgeom.analysis.e4.report import load_analysis

    steps = [0, 1, 2, 4, 16, 64, 256]
    rng = np.random.default_rng(2)
    rows = []
    for i, step in enumerate(steps):
        for layer in range(4):
            peak = 1 + np.exp(-((i - 3) ** 2) / 2)
            for metric in ("contrast_token_heads", "contrast_token", "contrast_weight"):
                rows.append((f"step{step}", step, layer, -1, metric, peak + 0.1 * layer))
            for h in range(4):
                rows.append((f"step{step}", step, layer, h, "pr_qk_token", 2 + h + rng.normal()))
                rows.append((f"step{step}", step, layer, h, "attn_entropy", 1 + 0.1 * h))
    metrics = pd.DataFrame(rows, columns=["checkpoint", "step", "layer", "head", "metric",
                                          "value"]).assign(block=-1, in_trends=True)
    folder = tmp_path / "e4"
    folder.mkdir()
    metrics.to_parquet(folder / "metrics.parquet", index=False)
    names = [f"step{s}" for s in steps]
    pd.DataFrame({"checkpoint": names, "step": steps, "arch": "gpt2", "n_head": 4,
                  "n_kv_head": 4, "seq_len": 64, "step_source": "name", "tokens": 512,
                  "tokens_per_s": 1000.0, "duplicate_of": None, "qk_hash": names,
                  "in_trends": True}).to_parquet(folder / "checkpoints.parquet", index=False)
    (folder / "analysis.json").write_text(json.dumps({"model": "tiny", "state": "done",
                                                      "settings": {}}))
    return load_analysis(folder)


def all_figures(tmp_path: Path) -> dict:
    """Every report figure at the preset sizes, laid out as saved: {name: Figure}."""
    from qkgeom.analysis.e1.figures import FIGURES
    from qkgeom.analysis.e3.figures import fig_e3_paired, fig_e3_trajectories
    from qkgeom.analysis.e4.figures import fig_contrast, fig_heads, fig_prefix

    e1 = e1_table()  # the token level: the weight level's figures have the same layout
    figs = {f"e1_{kind}_token": make(e1, "token") for kind, make in FIGURES.items()}
    one = e1_table(depths=(2,), inits=("normal",), seeds=(0,))  # one run: one panel
    figs |= {f"e1_one_run_{kind}_token": make(one, "token") for kind, make in FIGURES.items()}
    series, paired = e3_frames()
    figs["e3_trajectories"] = fig_e3_trajectories(series, STEPS[-1])
    figs["e3_paired"] = fig_e3_paired(paired, STEPS[-1])
    e4 = e4_tables(tmp_path)
    with matplotlib.rc_context(STYLE):  # as make_e4_figures draws them
        figs["e4_contrast"] = fig_contrast(e4["metrics"], e4["trends"], pd.DataFrame())
        figs["e4_prefix"] = fig_prefix(e4["prefix"], e4["trends"])
        figs["e4_heads"] = fig_heads(e4["metrics"], e4["heads"], {})
    for name, fig in figs.items():
        save_figure(fig, tmp_path, name)  # the layout pass the report runs
    return figs


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return all_figures(tmp_path_factory.mktemp("figures"))


def texts(fig) -> list[Text]:
    """The texts a drawn figure shows: tick labels only of ticks inside the axis' view
    (matplotlib keeps labels of the others, undrawn, at stale places)."""
    with matplotlib.rc_context(STYLE):  # as save_figure draws (ticks take the style)
        FigureCanvasAgg(fig).draw()
    hidden = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            pad = 1e-9 * max(1.0, abs(hi - lo))
            for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                loc = tick.get_loc()
                if loc is None or not (lo - pad <= loc <= hi + pad):
                    hidden |= {id(tick.label1), id(tick.label2)}
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()
            and id(t) not in hidden and all(a.get_visible() for a in _owners(t))]


def _owners(t: Text) -> list:
    axes = t.axes
    return [axes] if axes is not None else []


def test_every_text_lies_inside_its_figure(figures: dict) -> None:
    """Titles wrapped to the figure's width: nothing is cut at its edges."""
    for name, fig in figures.items():
        shown = texts(fig)
        renderer = fig.canvas.get_renderer()
        box = fig.bbox
        for t in shown:
            ext = t.get_window_extent(renderer)
            assert (ext.x0 >= box.x0 - 1 and ext.x1 <= box.x1 + 1 and ext.y0 >= box.y0 - 1
                    and ext.y1 <= box.y1 + 1), (name, t.get_text()[:60], ext, box)


def test_figure_text_is_readable_on_an_800_px_page(figures: dict) -> None:
    """The smallest text's em in CSS pixels when report.html shows the PNG at most
    :data:`PAGE_PX` wide (smaller PNGs at their own size)."""
    for name, fig in figures.items():
        width_px = fig.get_figwidth() * SCREEN_DPI
        px_per_pt = SCREEN_DPI / 72 * min(1.0, PAGE_PX / width_px)
        smallest = min(t.get_fontsize() for t in texts(fig))
        assert smallest * px_per_pt >= READABLE_PX, (name, smallest, fig.get_figwidth())


def _legend_key_colours(fig) -> set[tuple]:
    """Colours of the legend entries that are not layers (PR_Q/PR_K line styles)."""
    out = set()
    for legend in [a.get_legend() for a in fig.axes if a.get_legend()] + fig.legends:
        for handle, label in zip(legend.legend_handles, legend.get_texts(), strict=False):
            if not label.get_text().startswith(("layer", "L")) and isinstance(handle, Line2D):
                out.add(to_rgb(handle.get_color()))
    return out


def test_layer_colours_never_reuse_a_legend_key_colour(figures: dict) -> None:
    keys = _legend_key_colours(figures["e1_pr_token"])
    assert keys, "the PR figure's legend names PR_Q and PR_K"
    for n in range(1, 13):
        layers = {to_rgb(c) for c in layer_colors(n)}
        assert not layers & keys, (n, layers & keys)
        greys = [c for c in layers if max(c) - min(c) < 0.05]
        assert not greys, (n, greys)  # black and greys are the keys' and lines' colours
    drawn = {to_rgb(line.get_color()) for ax in figures["e1_pr_token"].axes
             for line in ax.get_lines() if len(line.get_xdata()) > 2}
    assert not drawn & keys


def expected_rho(table: pd.DataFrame, level: str) -> dict[str, float]:
    """E2.3's statistic per panel, from the table with scipy: Spearman ρ across the heads
    of each run's layer at the last probe, mean over the panel's runs and layers."""
    from scipy.stats import spearmanr

    heads = table[(table["head"] >= 0) & (table["step"] == STEPS[-1])]
    wide = heads.pivot_table(index=["depth", "qk_init", "run_id", "layer", "head"],
                             columns="metric", values="value").reset_index()
    out = {}
    for (depth, init), g in wide.groupby(["depth", "qk_init"]):
        rhos = [spearmanr(x[f"pr_qk_{level}"], x["attn_entropy"])[0]
                for _, x in g.groupby(["run_id", "layer"])]
        out[f"depth {depth} · {init}"] = float(np.mean(rhos))
    return out


def test_each_heads_panel_prints_its_rho_over_shared_axes(figures: dict) -> None:
    table = e1_table()
    for level in ("token",):
        fig = figures[f"e1_heads_{level}"]
        panels = [ax for ax in fig.axes if ax.collections]
        assert len(panels) == 9  # 3 depths × 3 inits
        want = expected_rho(table, level)
        for ax in panels:
            rho = [t.get_text() for t in ax.texts if "ρ" in t.get_text()]
            assert len(rho) == 1 and rho[0].startswith("ρ = "), (ax.get_title(), rho)
            # printed to 2 decimals (with 4 heads ρ moves in steps of 0.2: a mean may end
            # in 5 exactly, and either rounding is right)
            assert float(rho[0][4:]) == pytest.approx(want[ax.get_title()], abs=0.0051)
            assert all(ax.get_shared_x_axes().joined(ax, other) for other in panels)
        assert len({ax.get_xlim() for ax in panels}) == 1
        assert len({ax.get_ylim() for ax in panels}) == 1
