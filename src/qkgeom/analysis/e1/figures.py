"""Figures of E1/E2 from a collated sweep (matplotlib; PNG 150 dpi + SVG).

One panel per depth × Q/K init (a monitored run's column is its model), every figure at
the weight and the token level: ``pr`` (PR_Q solid and PR_K dashed, sharing axes: E1.3 is
about their gap), ``contrast``, ``qk_entropy`` and ``heads`` (every head at its run's last
probe, where E2.3 is measured, each panel printing its ρ). A figure whose metrics are not
recorded, or a trajectory of one probe step, is not drawn; the report says why. Style:
:mod:`qkgeom.analysis.figstyle`; what each shows: docs/report.md#figures.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from qkgeom.analysis import stats
from qkgeom.analysis.collate import GROUP, Collated
from qkgeom.analysis.e1.trajectories import LEVELS, reference_probe
from qkgeom.analysis.figstyle import (
    KEY_COLOR,
    REF_LINE,
    STYLE,
    ZERO_LINE,
    blank_panel,
    draw_spread,
    grid,
    layer_colors,
    save_figure,
    spread_note,
    step_axis,
    suptitle,
)
from qkgeom.analysis.kit import Drawn, missing_metrics

LEVEL_TITLE = {"weight": "weight level", "token": "token level (probe set)"}
#: (metric stem, line style, legend label) of the PR figure: PR_Q solid, PR_K dashed.
PR_LINES = (("pr_q", "-", "PR_Q"), ("pr_k", "--", "PR_K"))
TRAJECTORY_KINDS = ("pr", "contrast", "qk_entropy")  # need two probe steps or more


def _settings(table: pd.DataFrame) -> tuple[list[int], list[tuple[str, str]]]:
    depths = sorted(int(d) for d in table["depth"].unique())
    pairs = table[["qk_init", "variant"]].drop_duplicates()
    cols = sorted({(str(i), str(v)) for i, v in pairs.itertuples(index=False)})
    return depths, cols


def _label(init: str, variant: str) -> str:
    return init if not variant else f"{init} · {variant}"


def seeds_per_panel(table: pd.DataFrame) -> list[int]:
    """Runs (seeds) in each depth × init panel: what decides lines or a t-band."""
    if table.empty:
        return []
    return [int(n) for n in table.groupby(GROUP)["run_id"].nunique()]


def _group_ref(refs: dict[str, int], panel: pd.DataFrame) -> int | None:
    """The reference probe of one depth × init panel (rows of :func:`_panels`; ``refs``:
    each run's configured reference step): the first probed step ≥ its ref_step."""
    known = [refs[r] for r in panel["unit"].unique() if r in refs]
    if not known or panel.empty:
        return None
    return reference_probe(panel["step"].unique(), min(known))


_LOG_TICKS = (1.0, 2.0, 3.0, 5.0)  # labelled ticks of a log axis in each decade


def _log_y(ax: Axes) -> None:
    """A log y axis labelled at 1, 2, 3, 5 × 10^k (at least two labels in any range over
    1.7×), no minor ticks."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=_LOG_TICKS))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 3, 5, 10
    ax.yaxis.set_minor_locator(NullLocator())  # labelled ticks are enough, and cheaper


def _legend(ax: Axes, layers: list[int], styles: tuple[tuple[str, str], ...] = (),
            points: bool = False) -> None:
    """Layer colours (as lines, or dots when ``points``; and the line styles of
    ``styles``: (style, label)) beside ``ax``."""
    look = {"linestyle": "", "marker": "o", "markersize": 4} if points else {}
    handles = [Line2D([], [], color=c, label=f"layer {layer}", **look)
               for c, layer in zip(layer_colors(len(layers)), layers, strict=True)]
    handles += [Line2D([], [], color=KEY_COLOR, linestyle=ls, label=label)
                for ls, label in styles]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False,
              ncols=1 + len(handles) // 12)


Panel = tuple[int, str, str]  # depth, Q/K init, variant


def _panels(table: pd.DataFrame, metrics: set[str]) -> dict[Panel, pd.DataFrame]:
    """The whole-layer rows (head −1, layer ≥ 0) of ``metrics`` of each depth × init ×
    variant panel: run (``unit``), layer, metric, step, value. Grouped once, so drawing a
    panel filters nothing (pandas filters of a long table are the slow part)."""
    rows = table[(table["head"] == -1) & (table["layer"] >= 0) & table["metric"].isin(metrics)]
    rows = rows[[*GROUP, "run_id", "layer", "metric", "step", "value"]].rename(
        columns={"run_id": "unit"})
    return {(int(d), str(i), str(v)): g for (d, i, v), g in rows.groupby(GROUP, sort=False)}


def _trajectory_rows(table: pd.DataFrame, level: str, refs: dict[str, int] | None,
                     rows: list[tuple[tuple[tuple[str, str, str], ...], str, bool]],
                     title: str, zero: bool = False) -> Figure:
    """Rows = depth × ``rows``, columns = Q/K init. Each entry of ``rows`` is (lines,
    y label, log y), lines being (metric, line style, label) drawn per layer in the same
    panel. Panels share the step axis, and the y axis along each row (tick labels on the
    outer panels only: easier to compare, and much less text to lay out)."""
    refs = refs or {}
    depths, cols = _settings(table)
    fig, axes = grid(len(depths) * len(rows), len(cols), legend=True, sharex=True,
                     sharey="row")
    panels = _panels(table, {m for lines, _, _ in rows for m, _, _ in lines})
    for di, depth in enumerate(depths):
        for r, (lines, ylabel, log) in enumerate(rows):
            row = di * len(rows) + r
            drawn, layers = [], []
            for c, (init, variant) in enumerate(cols):
                ax = axes[row, c]
                if r == 0:  # the rows of one depth share their panels' titles
                    ax.set_title(f"depth {depth} · {_label(init, variant)}")
                if c == 0:
                    ax.set_ylabel(ylabel)
                if row == axes.shape[0] - 1:
                    ax.set_xlabel("training step")
                panel = panels.get((depth, init, variant))
                if panel is None:
                    blank_panel(ax, "no runs")  # e.g. every seed of it diverged
                    continue
                series = dict(tuple(panel.groupby(["metric", "layer"], sort=True)))
                panel_layers = sorted(int(x) for x in panel["layer"].unique())
                colors = layer_colors(len(panel_layers))
                for metric, style, _ in lines:
                    for color, layer in zip(colors, panel_layers, strict=True):
                        if (metric, layer) in series:
                            draw_spread(ax, series[(metric, layer)], color, linestyle=style)
                if zero:
                    ax.axhline(0.0, **ZERO_LINE)
                ref = _group_ref(refs, panel)
                if ref is not None:
                    ax.axvline(ref, **REF_LINE)
                step_axis(ax, float(panel["step"].max()))
                ax.margins(x=0.01)
                drawn.append(ax)
                layers = panel_layers if len(panel_layers) > len(layers) else layers
            if log:
                _log_y(axes[row, 0])  # shared: the whole row
            if drawn and r == 0:
                styles = tuple((s, lab) for _, s, lab in lines) if len(lines) > 1 else ()
                _legend(axes[row, -1], layers, styles)
    suptitle(fig, f"{title} — {LEVEL_TITLE[level]}; {spread_note(seeds_per_panel(table))}; "
             "dotted line: reference step")
    return fig


def fig_pr(table: pd.DataFrame, level: str = "weight",
           refs: dict[str, int] | None = None) -> Figure:
    """(a) PR_Q (solid) and PR_K (dashed) against step per depth × init, per layer
    (``refs``: each run's reference step, marked; none without)."""
    with matplotlib.rc_context(STYLE):
        lines = tuple((f"{m}_{level}", style, label) for m, style, label in PR_LINES)
        return _trajectory_rows(table, level, refs, [(lines, "participation ratio (dims)", True)],
                                "PR_Q (solid) and PR_K (dashed)")


def fig_contrast(table: pd.DataFrame, level: str = "weight",
                 refs: dict[str, int] | None = None) -> Figure:
    """(b) The paired contrast PR_Q − PR_K against step, per layer; 0 marked."""
    with matplotlib.rc_context(STYLE):
        lines = ((f"contrast_{level}", "-", "PR_Q − PR_K"),)
        return _trajectory_rows(table, level, refs, [(lines, "PR_Q − PR_K (dims)", False)],
                                "Paired contrast PR_Q − PR_K (above 0: queries "
                                "higher-dimensional)", zero=True)


def fig_qk_entropy(table: pd.DataFrame, level: str = "weight",
                   refs: dict[str, int] | None = None) -> Figure:
    """(c) Interaction PR (pr_qk) and attention entropy against step."""
    with matplotlib.rc_context(STYLE):
        return _trajectory_rows(
            table, level, refs,
            [(((f"pr_qk_{level}", "-", "pr_qk"),), "PR of QKᵀ spectrum (dims)", True),
             ((("attn_entropy", "-", "entropy"),), "attention entropy (nats)", False)],
            "Interaction spectrum and attention entropy")


def _last_probe(heads: pd.DataFrame) -> pd.DataFrame:
    """The rows of each run's last probe step."""
    last = heads.groupby("run_id")["step"].transform("max")
    return heads[heads["step"] == last]


def heads_rho(wide: pd.DataFrame, qk: str) -> tuple[float, int]:
    """E2.3's statistic in one panel: Spearman ρ across the heads of each layer of each
    run (``wide``: one row per head, columns ``qk`` and ``attn_entropy``), then the mean
    over those (run, layer) pairs; and how many there were (NaN, 0 when none has two heads
    with distinct values)."""
    rhos = []
    for _, g in wide.groupby(["run_id", "layer"]):
        g = g.dropna(subset=[qk, "attn_entropy"])
        if len(g) >= 2:
            rho, _ = stats.spearman(g[qk].to_numpy(), g["attn_entropy"].to_numpy())
            if np.isfinite(rho):
                rhos.append(float(rho))
    return (float(np.mean(rhos)) if rhos else float("nan")), len(rhos)


def fig_heads(table: pd.DataFrame, level: str = "weight",
              refs: dict[str, int] | None = None) -> Figure:
    """(d) pr_qk vs attention entropy for every head of every run at its last probe,
    coloured by layer (the E2.3 statistic is a ρ across the heads of a layer there; each
    panel prints it, :func:`heads_rho`); every panel on the same axes."""
    with matplotlib.rc_context(STYLE):
        depths, cols = _settings(table)
        heads = _last_probe(table[(table["head"] >= 0)
                                  & table["metric"].isin([f"pr_qk_{level}", "attn_entropy"])])
        wide = heads.pivot_table(index=["depth", "qk_init", "variant", "run_id", "layer",
                                        "head", "step"], columns="metric",
                                 values="value").reset_index()
        # one x and y range for every panel: E2.3 is compared across depths and inits
        fig, axes = grid(len(depths), len(cols), legend=True, sharex=True, sharey=True)
        for r, depth in enumerate(depths):
            layers: list[int] = []
            for c, (init, variant) in enumerate(cols):
                ax = axes[r, c]
                ax.set_title(f"depth {depth} · {_label(init, variant)}")
                w = wide[(wide["depth"] == depth) & (wide["qk_init"] == init)
                         & (wide["variant"] == variant)]
                if w.empty or f"pr_qk_{level}" not in w or "attn_entropy" not in w:
                    blank_panel(ax, "no runs")
                    continue
                layers = sorted(int(x) for x in w["layer"].unique())
                for color, layer in zip(layer_colors(len(layers)), layers, strict=True):
                    g = w[w["layer"] == layer]
                    ax.scatter(g[f"pr_qk_{level}"], g["attn_entropy"], color=color, s=9,
                               alpha=0.8, linewidths=0)
                rho, n = heads_rho(w, f"pr_qk_{level}")
                if n:
                    ax.text(0.03, 0.96, f"ρ = {rho:+.2f}", transform=ax.transAxes,
                            ha="left", va="top")
                ax.ticklabel_format(useOffset=False)  # no "1e-5+1" corner labels
                ax.xaxis.set_major_locator(MaxNLocator(4))
                if c == 0:
                    ax.set_ylabel("entropy (nats)")
                if r == len(depths) - 1:
                    ax.set_xlabel(f"pr_qk, {level} (dims)")
            if layers:
                _legend(axes[r, -1], layers, points=True)
        steps = sorted(int(s) for s in heads["step"].unique())
        at = (f"step {steps[0]}" if len(steps) == 1 else "each run's last probe")
        suptitle(fig, f"Heads at the last probe ({at}): interaction PR vs attention entropy — "
                 f"{LEVEL_TITLE[level]}; one point per head and run; ρ: the across-head "
                 "Spearman ρ, mean over the panel's layers and runs")
        return fig


FIGURES: dict[str, Callable[..., Figure]] = {
    "pr": fig_pr, "contrast": fig_contrast, "qk_entropy": fig_qk_entropy, "heads": fig_heads,
}


def figure_metrics(kind: str, level: str) -> tuple[str, ...]:
    """The metrics figure ``kind`` plots at ``level`` (the heads figure: per head)."""
    return {"pr": (f"pr_q_{level}", f"pr_k_{level}"), "contrast": (f"contrast_{level}",),
            "qk_entropy": (f"pr_qk_{level}", "attn_entropy"),
            "heads": (f"pr_qk_{level}", "attn_entropy")}[kind]


def missing_for(table: pd.DataFrame, kind: str, level: str) -> list[str]:
    """The metrics figure ``kind`` needs at ``level`` that ``table`` does not record."""
    rows = table[table["head"] >= 0] if kind == "heads" else table
    return missing_metrics(rows, figure_metrics(kind, level))


def not_drawable(table: pd.DataFrame, kind: str) -> str | None:
    """Why figure ``kind`` would be degenerate for ``table`` (None: it is not): a
    trajectory needs at least two probe steps."""
    if kind in TRAJECTORY_KINDS and table["step"].nunique() < 2:
        return "one probe step only: no trajectory to draw"
    return None


def make_figures(data: Collated, out_dir: str | Path) -> Drawn:
    """Every figure at every level into ``out_dir``, except those whose metrics the runs
    do not record (:func:`missing_for`) or that would show nothing (:func:`not_drawable`),
    which are listed instead."""
    drawn = Drawn(spread=spread_note(seeds_per_panel(data.metrics)))
    for kind in FIGURES:
        for level in LEVELS:
            name = f"{kind}_{level}"
            if missing := missing_for(data.metrics, kind, level):
                drawn.missing[name] = missing
            elif why := not_drawable(data.metrics, kind):
                drawn.empty[name] = why
            else:
                fig = FIGURES[kind](data.metrics, level, data.ref_steps)
                drawn.pngs[name] = save_figure(fig, out_dir, name)[0]
    return drawn
