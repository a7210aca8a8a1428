"""Figures of E1/E2 from a collated sweep, one panel per depth × Q/K init (a monitored
run's column is its model), at the weight and the token level. PR_Q and PR_K share axes
because E1.3 is about their gap. Style: :mod:`qkgeom.analysis.figstyle`; what each shows:
docs/report.md#figures.
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

from qkgeom.analysis import figstyle, stats
from qkgeom.analysis.collate import GROUP, Collated
from qkgeom.analysis.e1.trajectories import LEVELS, level_metrics, reference_probe
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


def _log_y(ax: Axes) -> None:
    """A log y axis labelled at 1, 2, 3, 5 × 10^k (two labels or more in any range over
    1.7×), no minor ticks."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 3, 5, 10
    ax.yaxis.set_minor_locator(NullLocator())  # labelled ticks are enough, and cheaper


def _legend(ax: Axes, layers: list[int], styles: tuple[tuple[str, str], ...] = (),
            points: bool = False) -> None:
    """Layer colours (lines, or dots when ``points``) and the line styles of ``styles``
    ((style, label)) beside ``ax``."""
    look = {"linestyle": "", "marker": "o", "markersize": 4} if points else {}
    handles = [Line2D([], [], color=c, label=f"layer {layer}", **look)
               for c, layer in zip(figstyle.layer_colors(len(layers)), layers, strict=True)]
    handles += [Line2D([], [], color=figstyle.KEY_COLOR, linestyle=ls, label=label)
                for ls, label in styles]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False,
              ncols=1 + len(handles) // 12)


def _panels(table: pd.DataFrame, metrics: set[str]) -> dict[tuple[int, str, str], pd.DataFrame]:
    """The whole-layer rows (head −1, layer ≥ 0) of ``metrics`` per depth × init × variant
    panel, the run as ``unit``: grouped once, as filtering a long table is the slow part."""
    rows = table[(table["head"] == -1) & (table["layer"] >= 0) & table["metric"].isin(metrics)]
    rows = rows[[*GROUP, "run_id", "layer", "metric", "step", "value"]].rename(
        columns={"run_id": "unit"})
    return {(int(d), str(i), str(v)): g for (d, i, v), g in rows.groupby(GROUP, sort=False)}


def _draw_panel(ax: Axes, panel: pd.DataFrame, lines: tuple[tuple[str, str, str], ...],
                refs: dict[str, int], zero: bool) -> list[int]:
    """One panel of :func:`_trajectory_rows` (``panel``: its rows of :func:`_panels`): each
    layer's line of every metric of ``lines``, 0 when ``zero``, and the reference probe
    (the first probed step ≥ its runs' ``refs``, when known); returns its layers."""
    series = dict(tuple(panel.groupby(["metric", "layer"], sort=True)))
    layers = sorted(int(x) for x in panel["layer"].unique())
    colors = figstyle.layer_colors(len(layers))
    for metric, style, _ in lines:
        for color, layer in zip(colors, layers, strict=True):
            if (metric, layer) in series:
                figstyle.draw_spread(ax, series[(metric, layer)], color, linestyle=style)
    if zero:
        ax.axhline(0.0, **figstyle.ZERO_LINE)
    known = [refs[r] for r in panel["unit"].unique() if r in refs]
    if known:
        ax.axvline(reference_probe(panel["step"].unique(), min(known)), **figstyle.REF_LINE)
    figstyle.step_axis(ax, float(panel["step"].max()))
    ax.margins(x=0.01)
    return layers


def _trajectory_rows(table: pd.DataFrame, level: str, refs: dict[str, int] | None,
                     rows: list[tuple[tuple[tuple[str, str, str], ...], str, bool]],
                     title: str, zero: bool = False) -> Figure:
    """Rows = depth × ``rows``, columns = Q/K init. Each entry of ``rows`` is (lines,
    y label, log y), lines being (metric, line style, label) drawn per layer in the same
    panel. Panels share the step axis, and the y axis along each row (tick labels on the
    outer panels only: easier to compare, and much less text to lay out)."""
    with matplotlib.rc_context(figstyle.STYLE):
        refs = refs or {}
        depths, cols = _settings(table)
        fig, axes = figstyle.grid(len(depths) * len(rows), len(cols), legend=True,
                                  sharex=True, sharey="row")
        panels = _panels(table, {m for lines, _, _ in rows for m, _, _ in lines})
        for di, depth in enumerate(depths):
            for r, (lines, ylabel, log) in enumerate(rows):
                row = di * len(rows) + r
                layers: list[int] = []  # the legend's: the panel with the most
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
                        figstyle.blank_panel(ax, "no runs")  # e.g. every seed of it diverged
                        continue
                    layers = max(layers, _draw_panel(ax, panel, lines, refs, zero), key=len)
                if log:
                    _log_y(axes[row, 0])  # shared: the whole row
                if layers and r == 0:
                    styles = tuple((s, lab) for _, s, lab in lines) if len(lines) > 1 else ()
                    _legend(axes[row, -1], layers, styles)
        figstyle.suptitle(fig, f"{title} — {LEVEL_TITLE[level]}; "
                          f"{figstyle.spread_note(seeds_per_panel(table))}; "
                          "dotted line: reference step")
        return fig


def fig_pr(table: pd.DataFrame, level: str = "weight",
           refs: dict[str, int] | None = None) -> Figure:
    """(a) PR_Q (solid) and PR_K (dashed) against step per depth × init, per layer
    (``refs``: each run's reference step, marked; none without)."""
    lines = tuple((f"{m}_{level}", style, label) for m, style, label in PR_LINES)
    return _trajectory_rows(table, level, refs, [(lines, "participation ratio (dims)", True)],
                            "PR_Q (solid) and PR_K (dashed)")


def fig_contrast(table: pd.DataFrame, level: str = "weight",
                 refs: dict[str, int] | None = None) -> Figure:
    """(b) The paired contrast PR_Q − PR_K against step, per layer; 0 marked."""
    lines = ((f"contrast_{level}", "-", "PR_Q − PR_K"),)
    return _trajectory_rows(table, level, refs, [(lines, "PR_Q − PR_K (dims)", False)],
                            "Paired contrast PR_Q − PR_K (above 0: queries "
                            "higher-dimensional)", zero=True)


def fig_qk_entropy(table: pd.DataFrame, level: str = "weight",
                   refs: dict[str, int] | None = None) -> Figure:
    """(c) Interaction PR (pr_qk) and attention entropy against step."""
    return _trajectory_rows(
        table, level, refs,
        [(((f"pr_qk_{level}", "-", "pr_qk"),), "PR of QKᵀ spectrum (dims)", True),
         ((("attn_entropy", "-", "entropy"),), "attention entropy (nats)", False)],
        "Interaction spectrum and attention entropy")


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
    with matplotlib.rc_context(figstyle.STYLE):
        depths, cols = _settings(table)
        heads = table[(table["head"] >= 0)
                      & table["metric"].isin([f"pr_qk_{level}", "attn_entropy"])]
        heads = heads[heads["step"] == heads.groupby("run_id")["step"].transform("max")]
        wide = heads.pivot_table(index=["depth", "qk_init", "variant", "run_id", "layer",
                                        "head", "step"], columns="metric",
                                 values="value").reset_index()
        # one x and y range for every panel: E2.3 is compared across depths and inits
        fig, axes = figstyle.grid(len(depths), len(cols), legend=True, sharex=True,
                                  sharey=True)
        for r, depth in enumerate(depths):
            layers: list[int] = []
            for c, (init, variant) in enumerate(cols):
                ax = axes[r, c]
                ax.set_title(f"depth {depth} · {_label(init, variant)}")
                w = wide[(wide["depth"] == depth) & (wide["qk_init"] == init)
                         & (wide["variant"] == variant)]
                if w.empty or f"pr_qk_{level}" not in w or "attn_entropy" not in w:
                    figstyle.blank_panel(ax, "no runs")
                    continue
                layers = sorted(int(x) for x in w["layer"].unique())
                for color, layer in zip(figstyle.layer_colors(len(layers)), layers,
                                        strict=True):
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
        figstyle.suptitle(
            fig, f"Heads at the last probe ({at}): interaction PR vs attention entropy — "
                 f"{LEVEL_TITLE[level]}; one point per head and run; ρ: the across-head "
                 "Spearman ρ, mean over the panel's layers and runs")
        return fig


FIGURES: dict[str, Callable[..., Figure]] = {
    "pr": fig_pr, "contrast": fig_contrast, "qk_entropy": fig_qk_entropy, "heads": fig_heads,
}
#: The metric stems (:func:`~qkgeom.analysis.e1.trajectories.level_metrics`) each figure
#: plots; the heads figure needs them per head.
FIGURE_METRICS = {"pr": ("pr_q", "pr_k"), "contrast": ("contrast",),
                  "qk_entropy": ("pr_qk", "attn_entropy"), "heads": ("pr_qk", "attn_entropy")}


def make_figures(data: Collated, out_dir: str | Path) -> Drawn:
    """Every figure at every level into ``out_dir``, except those whose metrics the runs
    do not record and the trajectories of a single probe step, which are listed instead."""
    table = data.metrics
    drawn = Drawn(spread=figstyle.spread_note(seeds_per_panel(table)))
    for kind, draw in FIGURES.items():
        rows = table[table["head"] >= 0] if kind == "heads" else table
        for level in LEVELS:
            name = f"{kind}_{level}"
            names = level_metrics(level)
            if missing := missing_metrics(rows, (names[m] for m in FIGURE_METRICS[kind])):
                drawn.missing[name] = missing
            elif kind in TRAJECTORY_KINDS and table["step"].nunique() < 2:
                drawn.empty[name] = "one probe step only: no trajectory to draw"
            else:
                fig = draw(table, level, data.ref_steps)
                drawn.pngs[name] = figstyle.save_figure(fig, out_dir, name)[0]
    return drawn
