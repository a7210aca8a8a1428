"""E4 figures of an analysed checkpoint family (matplotlib; PNG 300 dpi + SVG).

- ``contrast_steps``: PR_Q − PR_K per layer against step (log x; symlog when step 0 is
  there), token level and weight level; duplicate checkpoints as hollow markers;
- ``prefix_trend``: Mann–Kendall Z of growing prefixes against the prefix's last step, per
  layer, with the one-sided 5 % line (Z = 1.645) — where it stays above, the early regime;
- ``qk_entropy_heads``: pr_qk (token level) against attention entropy, one panel per
  checkpoint (at most 12, spread over the run), heads coloured by layer, ρ in the title.

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


def fig_contrast(metrics: pd.DataFrame) -> Figure:
    layer = metrics[metrics["head"] == -1]
    layers = sorted(layer["layer"].unique())
    colors = layer_colors(len(layers))[: len(layers)]
    fig = new_figure(7.0, 2.6)
    axes = fig.subplots(1, 2)
    for ax, level in zip(axes, ("token", "weight"), strict=True):
        sel = layer[layer["metric"] == f"contrast_{level}"]
        for c, lay in zip(colors, layers, strict=True):
            s = sel[sel["layer"] == lay].sort_values("step")
            kept = s[s["in_trends"]] if "in_trends" in s else s
            ax.plot(kept["step"], kept["value"], "-o", ms=2.5, color=c, label=f"L{lay}")
            if "in_trends" in s and (~s["in_trends"]).any():
                d = s[~s["in_trends"]]
                ax.plot(d["step"], d["value"], "o", mfc="none", ms=4, color=c)
        ax.axhline(0, color="0.6", lw=0.6, zorder=0)
        _xscale(ax, sel["step"].to_numpy(float))
        ax.set_ylabel("PR_Q − PR_K")
        ax.set_title(f"contrast per layer, {level} level")
    axes[1].legend(ncol=2 if len(layers) > 8 else 1, frameon=False, loc="best")
    return fig


def fig_prefix(prefix: pd.DataFrame, trends: pd.DataFrame) -> Figure:
    fig = new_figure(3.6, 2.6)
    ax = fig.subplots()
    sel = prefix[prefix["level"] == "token"]
    layers = sorted(sel["layer"].unique())
    for c, lay in zip(layer_colors(len(layers))[: len(layers)], layers, strict=True):
        s = sel[sel["layer"] == lay].sort_values("k")
        ax.plot(s["end_step"], s["mk_z"], "-o", ms=2.5, color=c, label=f"L{lay}")
        t = trends[(trends["level"] == "token") & (trends["layer"] == lay) & trends["has_regime"]]
        for end in t["regime_end_step"]:
            ax.axvline(end, color=c, lw=0.6, ls=":")
    ax.axhline(_Z_CRIT, color="0.3", ls="--", lw=0.8, label="p = 0.05")
    _xscale(ax, sel["end_step"].to_numpy(float) if len(sel) else np.array([1.0]))
    ax.set_xlabel("last step of the prefix")
    ax.set_ylabel("Mann–Kendall Z (increase)")
    ax.set_title("trend of growing prefixes (token level)")
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
                  & (heads["layer"] == -1)]
        rho = f"ρ = {r['rho'].iloc[0]:+.2f}" if len(r) and np.isfinite(r["rho"].iloc[0]) else ""
        ax.set_title(f"{ckpt} (step {int(step)}) {rho}", fontsize=6)
        ax.tick_params(labelsize=6)
    fig.supxlabel("pr_qk (token level)", fontsize=7)
    fig.supylabel("attention entropy (nats)", fontsize=7)
    return fig


def make_e4_figures(metrics: pd.DataFrame, trends: pd.DataFrame, prefix: pd.DataFrame,
                    heads: pd.DataFrame, out_dir: str | Path) -> dict[str, Path]:
    """Draw the three E4 figures into ``out_dir``; returns {name: PNG path}."""
    out = {}
    with matplotlib.rc_context(STYLE):
        for name, make in (("contrast_steps", lambda: fig_contrast(metrics)),
                           ("prefix_trend", lambda: fig_prefix(prefix, trends)),
                           ("qk_entropy_heads", lambda: fig_heads(metrics, heads))):
            out[name] = save_figure(make(), out_dir, name)[0]
    return out
