"""E4 figures of an analysed checkpoint family (matplotlib; PNG 150 dpi + SVG).

``contrast_steps`` (every contrast per layer against step, the primary with its bootstrap
band, peaks marked), ``prefix_trend`` (descriptive), ``qk_entropy_heads`` (one panel per
checkpoint, at most 12) and, for a set, ``e4_seeds``. A figure that would show nothing is
not drawn (:func:`degenerate_figures`); checkpoints whose step is not known are labelled
by name, never as a "step" (:mod:`.labels`). House style: :mod:`qkgeom.analysis.figstyle`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from scipy import stats as sst

from qkgeom.analysis.e4.labels import UNKNOWN_STEP, checkpoint_label, names_by_position
from qkgeom.analysis.e4.trends import PRIMARY, TREND_METRICS
from qkgeom.analysis.figstyle import (
    LEGEND_W,
    MAX_COLS,
    PANEL_H,
    PANEL_W,
    STYLE,
    ZERO_LINE,
    layer_colors,
    new_figure,
    save_figure,
)
from qkgeom.analysis.kit import Drawn

__all__ = ["degenerate_figures", "fig_seeds", "make_e4_figures", "make_e4_set_figure"]

_Z_CRIT = float(sst.norm.isf(0.05))
_MAX_PANELS = 12


def _xscale(ax: Axes, steps: np.ndarray, names: dict[float, str] | None,
            label: str = "step") -> None:
    if names is not None:
        ax.set_xticks(sorted(names), [names[s] for s in sorted(names)], rotation=30,
                      ha="right")
        ax.set_xlabel("checkpoint (in the order given; no step recorded)")
        return
    if len(steps) and np.nanmin(steps) <= 0:
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlim(left=-0.3)  # no empty negative half (steps are ≥ 0)
    else:
        ax.set_xscale("log")
    ax.set_xlabel(label)


def _shade_warmup(ax: Axes, warmup: int | None) -> None:
    """Grey band over the LR warm-up: its checkpoints are shown, not in the regime rule."""
    if warmup:
        ax.axvspan(-0.3, warmup, color="0.93", lw=0, zorder=-1)


def _mark_warmup_peak(ax: Axes, t: pd.DataFrame, color: Any) -> None:
    """△ at a layer's largest checkpoint inside the warm-up when it lies above the rule's
    first checkpoint (an early peak the rule does not test; descriptive)."""
    if "warmup_excess" not in t:
        return
    up = t[t["warmup_excess"] > 0]
    ax.plot(up["warmup_peak_step"], up["first"] + up["warmup_excess"], "^", ms=4,
            color=color, mfc="none", mew=0.8)


def fig_contrast(metrics: pd.DataFrame, trends: pd.DataFrame, band: pd.DataFrame,
                 names: dict[float, str] | None = None, warmup: int | None = None) -> Figure:
    layer = metrics[metrics["head"] == -1]
    layers = sorted(layer["layer"].unique())
    colors = layer_colors(len(layers))
    present = [m for m in TREND_METRICS if (layer["metric"] == m).any()] or ["contrast_token"]
    fig = new_figure(PANEL_W * len(present) + LEGEND_W, PANEL_H + 0.5)
    axes = np.atleast_1d(fig.subplots(1, len(present)))
    for ax, metric in zip(axes, present, strict=True):
        sel = layer[layer["metric"] == metric]
        for c, lay in zip(colors, layers, strict=True):
            s = sel[sel["layer"] == lay].sort_values("step")
            kept = s[s["in_trends"]] if "in_trends" in s else s
            ax.plot(kept["step"], kept["value"], "-o", ms=2.5, color=c, label=f"L{lay}")
            if metric == PRIMARY and len(band):
                b = band[band["layer"] == lay].sort_values("step")
                ax.fill_between(b["step"], b["low"], b["high"], color=c, alpha=0.2, lw=0)
            t = trends[(trends["metric"] == metric) & (trends["layer"] == lay)] \
                if len(trends) else trends
            if len(t):
                ax.plot(t["peak_step"], t["peak"], "D", ms=4, color=c, mec="k", mew=0.4)
                _mark_warmup_peak(ax, t, c)
            if "in_trends" in s and (~s["in_trends"]).any():
                d = s[~s["in_trends"]]
                ax.plot(d["step"], d["value"], "o", mfc="none", ms=4, color=c)
        ax.axhline(0, **ZERO_LINE)
        if names is None:
            _shade_warmup(ax, warmup)
        _xscale(ax, sel["step"].to_numpy(float), names)
        ax.set_ylabel("PR_Q − PR_K")
        ax.set_title(f"{metric}" + ("\n(primary)" if metric == PRIMARY else ""))
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, ncols=2 if len(layers) > 8 else 1, frameon=False,
               loc="outside right center")
    return fig


def fig_prefix(prefix: pd.DataFrame, trends: pd.DataFrame,
               names: dict[float, str] | None = None) -> Figure:
    fig = new_figure(PANEL_W + LEGEND_W, PANEL_H + 0.5)
    ax = fig.subplots()
    level = TREND_METRICS[PRIMARY] if (prefix["level"] == TREND_METRICS[PRIMARY]).any() \
        else "token"
    sel = prefix[prefix["level"] == level]
    layers = sorted(sel["layer"].unique())
    for c, lay in zip(layer_colors(len(layers)), layers, strict=True):
        s = sel[sel["layer"] == lay].sort_values("k")
        ax.plot(s["end_step"], s["mk_z"], "-o", ms=2.5, color=c, label=f"L{lay}")
        t = trends[(trends["level"] == level) & (trends["layer"] == lay) & trends["has_regime"]]
        for end in t["regime_end_step"]:
            ax.axvline(end, color=c, lw=0.6, ls=":")
    ax.axhline(_Z_CRIT, color="0.3", ls="--", lw=0.8, label="p = 0.05")
    _xscale(ax, sel["end_step"].to_numpy(float) if len(sel) else np.array([1.0]), names,
            "last step of the prefix")
    ax.set_ylabel("Mann–Kendall Z (increase)")
    ax.set_title(f"trend of growing prefixes\n({level})")
    if len(layers):
        handles, labels = ax.get_legend_handles_labels()
        fig.legend(handles, labels, frameon=False, ncols=2 if len(layers) > 8 else 1,
                   loc="outside right center")
    return fig


def _layer_key(fig: Figure, axes: np.ndarray, layers: list[int]) -> None:
    """Which colour is which layer: a legend up to 8 layers, a discrete colour bar beyond."""
    colors = layer_colors(len(layers))
    if len(layers) <= 8:
        from matplotlib.lines import Line2D

        fig.legend(handles=[Line2D([], [], ls="", marker="o", ms=4, color=c, label=f"L{lay}")
                            for c, lay in zip(colors, layers, strict=True)],
                   loc="outside right center", frameon=False, title="layer")
        return
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import BoundaryNorm, ListedColormap

    bounds = np.arange(len(layers) + 1) - 0.5
    mappable = ScalarMappable(BoundaryNorm(bounds, len(layers)), ListedColormap(colors))
    bar = fig.colorbar(mappable, ax=axes, shrink=0.8, aspect=30, pad=0.01)
    bar.set_ticks(np.arange(len(layers))[:: max(1, len(layers) // 8)])
    bar.set_label("layer")


def fig_heads(metrics: pd.DataFrame, heads: pd.DataFrame, sources: dict[str, str]) -> Figure:
    """``sources``: {checkpoint: step_source}, for the panel titles."""
    h = metrics[(metrics["head"] >= 0) & metrics["metric"].isin(["pr_qk_token", "attn_entropy"])]
    wide = h.pivot_table(index=["checkpoint", "step", "layer", "head"], columns="metric",
                         values="value").reset_index()
    ckpts = wide[["checkpoint", "step"]].drop_duplicates().sort_values("step")
    if len(ckpts) > _MAX_PANELS:
        idx = np.unique(np.linspace(0, len(ckpts) - 1, _MAX_PANELS).round().astype(int))
        ckpts = ckpts.iloc[idx]
    n = max(1, len(ckpts))
    cols = min(MAX_COLS, n)
    rows = (n + cols - 1) // cols
    fig = new_figure(PANEL_W * cols + LEGEND_W, (PANEL_H + 0.2) * rows + 0.5)
    axes = fig.subplots(rows, cols, squeeze=False, sharex=True, sharey=True)
    layers = sorted(int(x) for x in wide["layer"].unique()) if len(wide) else []
    colors = dict(zip(layers, layer_colors(len(layers)), strict=True))
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, (ckpt, step) in zip(axes.flat, ckpts.itertuples(index=False), strict=False):
        g = wide[wide["checkpoint"] == ckpt]
        if "pr_qk_token" not in g or "attn_entropy" not in g:
            continue
        ax.scatter(g["pr_qk_token"], g["attn_entropy"], s=8,
                   c=[colors[int(v)] for v in g["layer"]], linewidths=0)
        r = heads[(heads["checkpoint"] == ckpt) & (heads["level"] == "token")
                  & (heads["layer"] >= 0)]["rho"].dropna()
        rho = f"\nmean layer ρ = {r.mean():+.2f}" if len(r) else ""
        label = checkpoint_label(str(ckpt), step, sources.get(str(ckpt), UNKNOWN_STEP))
        ax.set_title(label + rho)
    fig.supxlabel("pr_qk (token level)", fontsize=STYLE["axes.labelsize"])
    fig.supylabel("attention entropy (nats)", fontsize=STYLE["axes.labelsize"])
    if layers:
        _layer_key(fig, axes, layers)
    return fig


def degenerate_figures(metrics: pd.DataFrame, prefix: pd.DataFrame) -> dict[str, str]:
    """The E4 figures that would show nothing here, with why: the contrast needs two
    checkpoints in the trends to be a trajectory, the prefix trend three."""
    n = metrics.loc[metrics["in_trends"], "step"].nunique() if "in_trends" in metrics \
        else metrics["step"].nunique()
    counted = f"{n} checkpoint{'' if n == 1 else 's'} in the trends"
    out = {}
    if n < 2:
        out["contrast_steps"] = f"{counted}: no trajectory to draw"
    if prefix.empty:
        out["prefix_trend"] = f"{counted}: a prefix trend needs at least 3"
    per_head = metrics[(metrics["head"] >= 0)]["metric"]
    if not {"pr_qk_token", "attn_entropy"} <= set(per_head):
        out["qk_entropy_heads"] = "no per-head pr_qk_token and attention entropy recorded"
    return out


def make_e4_figures(analysis: dict, band: pd.DataFrame, out_dir: str | Path) -> Drawn:
    """The E4 figures of one analysis folder (:func:`~qkgeom.analysis.e4.report.load_analysis`'s
    tables; ``band``: the block bootstrap's band of the primary contrast, maybe empty) into
    ``out_dir``; those of :func:`degenerate_figures` are listed instead."""
    a, ckpts = analysis, analysis["checkpoints"]
    sources = dict(zip(ckpts["checkpoint"].astype(str), ckpts["step_source"], strict=True))
    names = names_by_position(ckpts[ckpts["in_trends"]] if "in_trends" in ckpts else ckpts)
    drawn = Drawn(empty=degenerate_figures(a["metrics"], a["prefix"]))
    with matplotlib.rc_context(STYLE):
        for name, make in (
                ("contrast_steps", lambda: fig_contrast(a["metrics"], a["trends"], band, names,
                                                        a["warmup"])),
                ("prefix_trend", lambda: fig_prefix(a["prefix"], a["trends"], names)),
                ("qk_entropy_heads", lambda: fig_heads(a["metrics"], a["heads"], sources))):
            if name not in drawn.empty:
                drawn.pngs[name] = save_figure(make(), out_dir, name)[0]
    return drawn


def fig_seeds(units: dict[str, tuple[pd.DataFrame, pd.DataFrame]], warmup: int | None
              ) -> Figure:
    """The primary contrast per layer (one panel each), one line per seed; the warm-up
    shaded; ◆ the peak of a layer called rise then fall, ○ the others' peaks, △ a peak
    inside the warm-up above the rule's first checkpoint; each panel titled with its calls
    over seeds."""
    from qkgeom.analysis.e4.regime import CALLS, RISE_FALL

    layers = sorted({int(v) for m, _ in units.values()
                     for v in m.loc[(m["metric"] == PRIMARY) & (m["head"] == -1), "layer"]})
    cols = min(4, max(1, len(layers)))
    rows = (len(layers) + cols - 1) // cols or 1
    fig = new_figure(2.6 * cols + 0.3, 2.1 * rows + 0.3)
    axes = fig.subplots(rows, cols, squeeze=False)
    colors = layer_colors(len(units))
    for ax in axes.flat[len(layers):]:
        ax.axis("off")
    for ax, lay in zip(axes.flat, layers, strict=False):
        calls = []
        for c, (unit, (metrics, trends)) in zip(colors, units.items(), strict=True):
            s = metrics[(metrics["metric"] == PRIMARY) & (metrics["head"] == -1)
                        & (metrics["layer"] == lay)]
            s = s[s["in_trends"]] if "in_trends" in s else s
            s = s.sort_values("step")
            ax.plot(s["step"], s["value"], "-", lw=0.9, color=c, label=str(unit))
            t = trends[(trends["metric"] == PRIMARY) & (trends["layer"] == lay)] \
                if len(trends) else trends
            for r in t.itertuples():
                calls.append(r.call)
                ax.plot([r.peak_step], [r.peak], "D" if r.call == RISE_FALL else "o",
                        ms=4, color=c, mec="k", mew=0.4,
                        mfc=c if r.call == RISE_FALL else "none")
            _mark_warmup_peak(ax, t, c)
        ax.axhline(0, **ZERO_LINE)
        steps = np.concatenate([m["step"].to_numpy(float) for m, _ in units.values()])
        _shade_warmup(ax, warmup)
        _xscale(ax, steps, None)
        counts = [f"{calls.count(c)} {c}" for c in CALLS if calls.count(c)]
        ax.set_title(f"layer {lay}\n" + ", ".join(counts), fontsize=6)
    for row in axes:
        row[0].set_ylabel("PR_Q − PR_K (token, head mean)", fontsize=6)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", frameon=False, fontsize=6,
               title="seed", title_fontsize=6)
    return fig


def make_e4_set_figure(units: dict[str, tuple[pd.DataFrame, pd.DataFrame]],
                       warmup: int | None, out_dir: str | Path) -> Drawn:
    """Draw :func:`fig_seeds` into ``out_dir`` as ``e4_seeds`` (none when no seed records
    the primary contrast)."""
    if not any(((m["metric"] == PRIMARY) & (m["head"] == -1)).any() for m, _ in units.values()):
        return Drawn()
    with matplotlib.rc_context(STYLE):
        return Drawn({"e4_seeds": save_figure(fig_seeds(units, warmup), out_dir, "e4_seeds")[0]})
