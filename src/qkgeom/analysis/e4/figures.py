"""E4 figures of an analysed checkpoint family (matplotlib; PNG 300 dpi + SVG).

- ``contrast_steps``: PR_Q − PR_K per layer against step (log x; symlog when step 0 is
  there), one panel per recorded contrast (the primary, head-mean token contrast first,
  with its 95 % token-block bootstrap band); the peak of each layer marked (◆); duplicate
  checkpoints as hollow markers;
- ``prefix_trend`` (descriptive): Mann–Kendall Z of growing prefixes against the prefix's
  last step, per layer, with the one-sided 5 % line (Z = 1.645);
- ``qk_entropy_heads``: pr_qk (token level) against attention entropy, one panel per
  checkpoint (at most 12, spread over the run), heads coloured by layer, the mean per-layer
  ρ in the title.

House style of :mod:`qkgeom.analysis.kit`, drawn on bare Figures (no pyplot).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from scipy import stats as sst

from qkgeom.analysis.e4.trends import PRIMARY, TREND_METRICS
from qkgeom.analysis.kit import STYLE, layer_colors, new_figure, save_figure

__all__ = ["make_e4_figures"]

_Z_CRIT = float(sst.norm.isf(0.05))
_MAX_PANELS = 12


def _xscale(ax: Axes, steps: np.ndarray) -> None:
    if len(steps) and np.nanmin(steps) <= 0:
        ax.set_xscale("symlog", linthresh=1)
    else:
        ax.set_xscale("log")
    ax.set_xlabel("step")


def fig_contrast(metrics: pd.DataFrame, trends: pd.DataFrame, band: pd.DataFrame) -> Figure:
    layer = metrics[metrics["head"] == -1]
    layers = sorted(layer["layer"].unique())
    colors = layer_colors(len(layers))[: len(layers)]
    present = [m for m in TREND_METRICS if (layer["metric"] == m).any()] or ["contrast_token"]
    fig = new_figure(3.5 * len(present), 2.6)
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
            if "in_trends" in s and (~s["in_trends"]).any():
                d = s[~s["in_trends"]]
                ax.plot(d["step"], d["value"], "o", mfc="none", ms=4, color=c)
        ax.axhline(0, color="0.6", lw=0.6, zorder=0)
        _xscale(ax, sel["step"].to_numpy(float))
        ax.set_ylabel("PR_Q − PR_K")
        ax.set_title(f"{metric}" + (" (primary)" if metric == PRIMARY else ""))
    axes[-1].legend(ncol=2 if len(layers) > 8 else 1, frameon=False, loc="best")
    return fig


def fig_prefix(prefix: pd.DataFrame, trends: pd.DataFrame) -> Figure:
    fig = new_figure(3.6, 2.6)
    ax = fig.subplots()
    level = TREND_METRICS[PRIMARY] if (prefix["level"] == TREND_METRICS[PRIMARY]).any() \
        else "token"
    sel = prefix[prefix["level"] == level]
    layers = sorted(sel["layer"].unique())
    for c, lay in zip(layer_colors(len(layers))[: len(layers)], layers, strict=True):
        s = sel[sel["layer"] == lay].sort_values("k")
        ax.plot(s["end_step"], s["mk_z"], "-o", ms=2.5, color=c, label=f"L{lay}")
        t = trends[(trends["level"] == level) & (trends["layer"] == lay) & trends["has_regime"]]
        for end in t["regime_end_step"]:
            ax.axvline(end, color=c, lw=0.6, ls=":")
    ax.axhline(_Z_CRIT, color="0.3", ls="--", lw=0.8, label="p = 0.05")
    _xscale(ax, sel["end_step"].to_numpy(float) if len(sel) else np.array([1.0]))
    ax.set_xlabel("last step of the prefix")
    ax.set_ylabel("Mann–Kendall Z (increase)")
    ax.set_title(f"trend of growing prefixes ({level})")
    if len(layers):
        ax.legend(frameon=False, fontsize=6, ncol=2 if len(layers) > 8 else 1)
    return fig


def fig_heads(metrics: pd.DataFrame, heads: pd.DataFrame) -> Figure:
    h = metrics[(metrics["head"] >= 0) & metrics["metric"].isin(["pr_qk_token", "attn_entropy"])]
    wide = h.pivot_table(index=["checkpoint", "step", "layer", "head"], columns="metric",
                         values="value").reset_index()
    ckpts = wide[["checkpoint", "step"]].drop_duplicates().sort_values("step")
    if len(ckpts) > _MAX_PANELS:
        idx = np.unique(np.linspace(0, len(ckpts) - 1, _MAX_PANELS).round().astype(int))
        ckpts = ckpts.iloc[idx]
    n = max(1, len(ckpts))
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig = new_figure(1.9 * cols + 0.4, 1.7 * rows + 0.3)
    axes = fig.subplots(rows, cols, squeeze=False)
    layers = sorted(wide["layer"].unique()) if len(wide) else []
    colors = dict(zip(layers, layer_colors(len(layers))[: len(layers)], strict=True))
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, (ckpt, step) in zip(axes.flat, ckpts.itertuples(index=False), strict=False):
        g = wide[wide["checkpoint"] == ckpt]
        if "pr_qk_token" not in g or "attn_entropy" not in g:
            continue
        ax.scatter(g["pr_qk_token"], g["attn_entropy"], s=6,
                   c=[colors[v] for v in g["layer"]], linewidths=0)
        r = heads[(heads["checkpoint"] == ckpt) & (heads["level"] == "token")
                  & (heads["layer"] >= 0)]["rho"].dropna()
        rho = f"mean layer ρ = {r.mean():+.2f}" if len(r) else ""
        ax.set_title(f"{ckpt} (step {int(step)}) {rho}", fontsize=6)
        ax.tick_params(labelsize=6)
    fig.supxlabel("pr_qk (token level)", fontsize=7)
    fig.supylabel("attention entropy (nats)", fontsize=7)
    return fig


def make_e4_figures(metrics: pd.DataFrame, trends: pd.DataFrame, prefix: pd.DataFrame,
                    heads: pd.DataFrame, band: pd.DataFrame,
                    out_dir: str | Path) -> dict[str, Path]:
    """Draw the three E4 figures into ``out_dir`` (``band``: the block bootstrap's
    percentile band of the primary contrast, maybe empty); returns {name: PNG path}."""
    out = {}
    with matplotlib.rc_context(STYLE):
        for name, make in (("contrast_steps", lambda: fig_contrast(metrics, trends, band)),
                           ("prefix_trend", lambda: fig_prefix(prefix, trends)),
                           ("qk_entropy_heads", lambda: fig_heads(metrics, heads))):
            out[name] = save_figure(make(), out_dir, name)[0]
    return out
