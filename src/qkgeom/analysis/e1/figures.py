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
from qkgeom.analysis.e1.claims import CLAIMS, PRIMARY, SENSITIVITY_CLAIMS
from qkgeom.analysis.e1.ladder import ORDER, setting_of
from qkgeom.analysis.e1.trajectories import LEVELS, level_metrics, reference_probe
from qkgeom.analysis.figstyle import KEY_COLOR
from qkgeom.analysis.kit import Drawn, fmt_p, missing_metrics

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


def make_figures(data: Collated, out_dir: str | Path,
                 e1: dict[str, pd.DataFrame] | None = None) -> Drawn:
    """Every figure at every level into ``out_dir``, except those whose metrics the runs
    do not record and the trajectories of a single probe step, which are listed instead;
    with ``e1`` (:func:`qkgeom.analysis.e1.report.e1_claims`'s tables) also the ladder's
    effects against width, the per-layer figure and the reference sensitivity."""
    table = data.metrics
    drawn = Drawn(spread=figstyle.spread_note(seeds_per_panel(table)))
    if e1 is not None and len(e1.get("settings", ())):
        fig = fig_ladder(e1["seed_effects"], e1["trend"])
        drawn.pngs["ladder_effects"] = figstyle.save_figure(fig, out_dir, "ladder_effects")[0]
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
    if e1 is None:
        return drawn
    per_layer = e1["run_layers"]
    models = ", ".join(_label(i, v) for i, v in _settings(table)[1])  # named in each title
    if table["step"].nunique() < 2:
        drawn.empty["per_layer"] = "one probe step only: no change to show"
    elif len(per_layer) and (per_layer["level"] == "token").any():
        hue, order, pooled = "depth", None, True
        if len(e1.get("settings", ())):
            per_layer = per_layer.assign(setting=setting_of(per_layer, e1["settings"]))
            hue, order, pooled = "setting", list(e1["settings"]["setting"]), False
        drawn.pngs["per_layer"] = figstyle.save_figure(
            fig_per_layer(per_layer, hue, order, pooled, models), out_dir, "per_layer")[0]
    else:
        drawn.empty["per_layer"] = "no token-level statistics"
    if len(e1["sensitivity"]):
        summary = e1["sensitivity"]
        if len(e1.get("settings", ())):
            labels = dict(zip(e1["settings"]["variant"], e1["settings"]["setting"],
                              strict=False))
            summary = summary.assign(variant=summary["variant"].map(labels)
                                     .fillna(summary["variant"]))
        drawn.pngs["reference_sensitivity"] = figstyle.save_figure(
            fig_reference_sensitivity(summary, e1["sensitivity_runs"], models), out_dir,
            "reference_sensitivity")[0]
    else:
        drawn.empty["reference_sensitivity"] = "no probe between 5 % and 75 % of the run"
    return drawn


# ---------------------------------------------------------------------------------------
# Protocol 2: per-layer effects, reference sensitivity, the width ladder
# ---------------------------------------------------------------------------------------

#: The claims' primary statistics in the per-layer and ladder figures: (claim, statistic,
#: y label). E1.2 first: the claim whose run-level verdict a single layer can decide.
PRIMARY_PANELS = (
    ("E1.2", "delta_pr_k", "ΔPR_K (dims)"), ("E1.1", "delta_pr_q", "ΔPR_Q (dims)"),
    ("E1.3", "contrast_time_mean", "time-avg PR_Q − PR_K"),
    ("E2.1", "rho_k_qk_vs_null", "ρ within − cross-run"),
    ("E2.2", "rho_qk_entropy_vs_null", "ρ within − cross-run"),
    ("E2.3", "rho_heads_qk_entropy", "ρ across heads"),
)
_MEAN_STYLE = {"color": KEY_COLOR, "marker": "D", "markersize": 4, "linestyle": "",
               "zorder": 5}


def _mean_ci(ax: Axes, x: float, values: np.ndarray) -> None:
    """The mean of ``values`` at ``x`` with its 95 % t-interval (a bar from 2 values)."""
    mean, lo, hi, n = stats.t_interval(values)
    if not n:
        return
    ax.plot([x], [mean], **_MEAN_STYLE)
    if np.isfinite(lo):
        ax.plot([x, x], [lo, hi], color=KEY_COLOR, linewidth=1.0, zorder=5)


def fig_per_layer(per_layer: pd.DataFrame, hue: str = "depth",
                  order: list[str] | None = None, pooled: bool = True,
                  models: str = "") -> Figure:
    """Every run's per-layer value of each claim's primary statistic (token level, from
    the reference; E2.3 at the last checkpoint) against the layer index, one colour per
    ``hue`` value (depth, or the ladder's setting, in ``order``) and, at the right, the
    run-level value (mean over the run's layers, the primary row's unit). ``pooled``: each
    layer's mean over all runs with its t-interval (black), as the per-layer rows pool
    them; otherwise (a ladder, whose settings are never pooled) each group's own mean."""
    sign = {c.id: c.sign for c in CLAIMS}
    origin = {c.id: PRIMARY[1] if c.per_origin else "step0" for c in CLAIMS}
    with matplotlib.rc_context(figstyle.STYLE):
        fig, axes = figstyle.grid(2, 3, legend=True)
        present = set(per_layer[hue].astype(str)) if len(per_layer) else set()
        groups = [g for g in (order or sorted(present)) if g in present]
        colors = dict(zip(groups, figstyle.layer_colors(len(groups)), strict=True))
        for ax, (cid, stat, ylabel) in zip(axes.ravel(), PRIMARY_PANELS, strict=True):
            sel = per_layer[(per_layer["level"] == PRIMARY[0])
                            & (per_layer["origin"] == origin[cid])] if len(per_layer) else \
                per_layer
            arrow = "↑" if sign[cid] > 0 else "↓"
            ax.set_title(f"{cid} (predicted {arrow})")
            if sel.empty or stat not in sel or not np.isfinite(sel[stat]).any():
                figstyle.blank_panel(ax, "not measured")
                continue
            layers = sorted(int(x) for x in sel["layer"].unique())
            width = 0.6 / max(len(groups), 1)
            right = layers[-1] + 1.2
            for gi, g in enumerate(groups):
                part = sel[sel[hue].astype(str) == g]
                shift = -0.3 + width * (gi + 0.5)
                x = part["layer"].to_numpy(dtype=float) + shift
                ax.scatter(x, part[stat], s=8, color=colors[g], alpha=0.75, linewidths=0)
                means = part.groupby("run_id")[stat].mean().to_numpy()
                ax.scatter(np.full(len(means), right + shift), means, s=8, color=colors[g],
                           alpha=0.75, linewidths=0)
                if not pooled:
                    for layer in layers:
                        _mean_ci(ax, layer + shift,
                                 part.loc[part["layer"] == layer, stat].to_numpy())
                    _mean_ci(ax, right + shift, means)
            if pooled:
                for layer in layers:
                    _mean_ci(ax, float(layer), sel.loc[sel["layer"] == layer, stat].to_numpy())
                _mean_ci(ax, right, sel.groupby("run_id")[stat].mean().to_numpy())
            ax.axhline(0.0, **figstyle.ZERO_LINE)
            ax.set_xticks([*layers, right], [*map(str, layers), "mean"])
            ax.set_ylabel(ylabel)
            ax.set_xlabel("layer")
        handles = [Line2D([], [], color=colors[g], marker="o", linestyle="", markersize=4,
                          label=f"{hue} {g}" if hue == "depth" else g) for g in groups]
        handles.append(Line2D([], [], **{**_MEAN_STYLE, "zorder": None},
                              label="mean ± 95 % t"))
        axes[0, -1].legend(handles=handles, loc="center left", bbox_to_anchor=(1.02, 0.5),
                           frameon=False)
        figstyle.suptitle(fig, "Per layer (secondary): each run's value of every claim's "
                               "primary statistic per layer index, token level, from the "
                               "reference (E2.3: last probe); right: the run's mean over its "
                               "layers (the primary unit); black: mean ± 95 % t" +
                               ("" if pooled else " per " + hue) +
                               (f"; models: {models}" if models else ""))
        return fig


def fig_reference_sensitivity(summary: pd.DataFrame, per_run: pd.DataFrame,
                              models: str = "") -> Figure:
    """E1.1's and E1.2's effects (mean over runs, 95 % t-band) against the reference step,
    rows the token and the weight level, one colour per setting; thin lines: each run
    (one setting only); dotted: the protocol's reference (secondary, descriptive)."""
    with matplotlib.rc_context(figstyle.STYLE):
        levels = [lv for lv in ("token", "weight") if (summary["level"] == lv).any()] \
            or ["token"]
        fig, axes = figstyle.grid(len(levels), 2, legend=True, sharex=True)
        variants = sorted(summary["variant"].astype(str).unique()) if len(summary) else []
        colors = dict(zip(variants, figstyle.layer_colors(len(variants)), strict=True))
        for r, level in enumerate(levels):
            for c, (cid, stat, _sign) in enumerate(SENSITIVITY_CLAIMS):
                ax = axes[r, c]
                name = "ΔPR_Q" if c == 0 else "ΔPR_K"
                ax.set_title(f"{cid} {name} · {level} level")
                sel = summary[(summary["level"] == level) & (summary["claim_id"] == cid)]
                if sel.empty or not np.isfinite(sel["mean"].to_numpy(dtype=float)).any():
                    figstyle.blank_panel(ax, "not measured")
                    continue
                for v in variants:
                    part = sel[sel["variant"].astype(str) == v].sort_values("reference_step")
                    x = part["reference_step"].to_numpy(dtype=float)
                    ax.plot(x, part["mean"], color=colors[v], marker="o", markersize=3)
                    ax.fill_between(x, part["ci_low"], part["ci_high"], color=colors[v],
                                    alpha=0.15, linewidth=0)
                if len(variants) == 1 and len(per_run):
                    runs = per_run[per_run["level"] == level]
                    for _, g in runs.groupby("run_id"):
                        g = g.sort_values("reference_step")
                        ax.plot(g["reference_step"], g[stat], color=colors[variants[0]],
                                linewidth=figstyle.SEED_LINEWIDTH, alpha=0.35)
                primary = sel.loc[sel["primary"], "reference_step"]
                for step in sorted(set(primary.astype(int))):
                    ax.axvline(step, **figstyle.REF_LINE)
                ax.axhline(0.0, **figstyle.ZERO_LINE)
                ax.set_ylabel(f"{name} to the end (dims)")
                if r == len(levels) - 1:
                    ax.set_xlabel("reference step")
                figstyle.step_axis(ax, float(sel["reference_step"].max()))
        handles = [Line2D([], [], color=colors[v], label=v or "mean over runs")
                   for v in variants]
        handles.append(Line2D([], [], **figstyle.REF_LINE, label="protocol's reference"))
        axes[0, -1].legend(handles=handles, loc="center left", bbox_to_anchor=(1.02, 0.5),
                           frameon=False)
        figstyle.suptitle(fig, "Reference sensitivity (secondary, descriptive): the E1.1 and "
                               "E1.2 effects with the reference at every probe from 5 % to "
                               "75 % of the run; mean over runs ± 95 % t-interval" +
                               (f"; models: {models}" if models else ""))
        return fig


def _width_axis(ax: Axes, widths: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.minorticks_off()
    ax.set_xlabel("width (d_model)")


def _trend_title(r: pd.Series) -> str:
    """A trend row in a panel title: the verdict, its direction and the Holm p."""
    direction = r["direction"] if isinstance(r["direction"], str) else ""
    text = r["verdict"] + (f", {direction.removesuffix(' the claim')}" if direction else "")
    return f"{text}; p (Holm) {fmt_p(r['p_adj'])}"


def fig_ladder(effects: pd.DataFrame, trend: pd.DataFrame) -> Figure:
    """Each primary effect against width (E1.2 first): every seed's runs joined across the
    rungs (thin), the mean over seeds with its 95 % t-interval per width (black), the arms
    as open markers at their width; each panel's title gives the trend row's verdict."""
    labels = {cid: ylabel for cid, _, ylabel in PRIMARY_PANELS}
    with matplotlib.rc_context(figstyle.STYLE):
        fig, axes = figstyle.grid(2, 3, legend=True)
        rungs = effects[effects["rung"]] if len(effects) else effects
        widths = sorted(int(w) for w in rungs["width"].unique()) if len(rungs) else []
        arms = sorted(effects.loc[~effects["rung"], "setting"].unique()) if len(effects) \
            else []
        arm_colors = dict(zip(arms, figstyle.LAYER_PALETTE[1:], strict=False))
        verdicts = dict(zip(trend["claim_id"], [_trend_title(r) for _, r in trend.iterrows()],
                            strict=True)) if len(trend) else {}
        for ax, cid in zip(axes.ravel(), ORDER, strict=True):
            ax.set_title(f"{cid}\n" + verdicts.get(cid, ""), fontsize=8)
            sel = rungs[rungs["claim_id"] == cid] if len(rungs) else rungs
            if sel.empty or not np.isfinite(sel["value"].to_numpy(dtype=float)).any():
                figstyle.blank_panel(ax, "not measured")
                continue
            wide = sel.pivot_table(index="seed", columns="width", values="value")
            for _, row in wide.iterrows():
                ok = row.notna()
                ax.plot(row.index[ok], row[ok], color=figstyle.LAYER_PALETTE[0],
                        linewidth=figstyle.SEED_LINEWIDTH, alpha=0.5, marker="o",
                        markersize=2.5)
            for w in wide.columns:
                _mean_ci(ax, float(w), wide[w].to_numpy(dtype=float))
            for arm in arms:
                part = effects[(effects["setting"] == arm) & (effects["claim_id"] == cid)]
                if len(part):
                    x = float(part["width"].iloc[0]) * 1.12
                    ax.scatter(np.full(len(part), x), part["value"], s=12,
                               facecolors="none", edgecolors=arm_colors[arm], linewidths=0.8)
                    _mean_ci(ax, x, part["value"].to_numpy(dtype=float))
            ax.axhline(0.0, **figstyle.ZERO_LINE)
            _width_axis(ax, widths)
            ax.set_ylabel(labels[cid])
        handles = [Line2D([], [], color=figstyle.LAYER_PALETTE[0], marker="o", markersize=2.5,
                          linewidth=figstyle.SEED_LINEWIDTH, label="one seed"),
                   Line2D([], [], **{**_MEAN_STYLE, "zorder": None}, label="mean ± 95 % t")]
        handles += [Line2D([], [], color=arm_colors[a], marker="o", markerfacecolor="none",
                           linestyle="", label=a) for a in arms]
        axes[0, -1].legend(handles=handles, loc="center left", bbox_to_anchor=(1.02, 0.5),
                           frameon=False)
        figstyle.suptitle(fig, "Width ladder: each claim's primary effect per seed against "
                               "width (token level, from the reference; E2.3 last probe); "
                               "titles: the trend test over seeds (slope on log₂ width)")
        return fig


def fig_width_effects(e1: pd.DataFrame, e3: pd.DataFrame) -> Figure:
    """The README's verdict-by-width figure: E1.2's effect (token ΔPR_K from the reference,
    per seed; :func:`qkgeom.analysis.e1.ladder.e12_by_width`) and E3.1's (scale-free
    entropy, shrink-0.5 − none over the whole run, per seed;
    :func:`qkgeom.analysis.e1.ladder.e3_by_width`) against width, each table ``width,
    seed, effect``; per width the mean over seeds and its 95 % t-interval."""
    panels = ((e1, "E1.2 PR_K shrinks (< 0)", "ΔPR_K from the reference"),
              (e3, "E3.1 shrinking sharpens (< 0)", "Δ scale-free entropy"))
    with matplotlib.rc_context(figstyle.STYLE):
        fig, axes = figstyle.grid(1, 2)
        for ax, (table, title, ylabel) in zip(axes[0], panels, strict=True):
            ax.set_title(title)
            if table is None or table.empty:
                figstyle.blank_panel(ax, "no runs")
                continue
            widths = sorted(int(w) for w in table["width"].unique())
            for w in widths:
                values = table.loc[table["width"] == w, "effect"].to_numpy(dtype=float)
                ax.scatter(np.full(len(values), float(w)), values, s=10,
                           color=figstyle.LAYER_PALETTE[0], alpha=0.6, linewidths=0)
                _mean_ci(ax, float(w), values)
            ax.axhline(0.0, **figstyle.ZERO_LINE)
            _width_axis(ax, widths)
            ax.set_ylabel(ylabel)
        figstyle.suptitle(fig, "Effects against width: one point per seed; black: mean "
                               "± 95 % t; E3.1: shrink-0.5 − none, whole run")
        return fig
