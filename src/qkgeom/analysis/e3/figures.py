"""Figures of E3 (key-spectrum control): trajectories per mode and paired differences.

House style of :mod:`qkgeom.analysis.kit` (paper-column panels, 8 pt text, PNG 300 dpi
+ SVG, key-control modes in Okabe–Ito colours). A dotted vertical line marks the end of
the early phase (25 % of the run).

- ``e3_trajectories``: attention entropy, pr_qk (token), PR_K (weight) and validation loss
  against step, whole-model (layer mean), one line per mode: seed mean ± 95 % t-interval.
- ``e3_paired``: the paired differences (mode − none) per seed against step, one thin line
  per seed and the seed mean thick, one row per controlled mode.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from scipy import stats as sst

from qkgeom.analysis.e3.paired import BASELINE, EARLY_SHARE
from qkgeom.analysis.kit import (
    REF_LINE,
    STYLE,
    grid,
    mode_color,
    save_figure,
    step_axis,
    suptitle,
)

# Short panel titles (the long labels are in qkgeom.analysis.e3.paired.QUANTITIES).
SHORT = {"attn_entropy": "attention entropy (nats)", "pr_qk_token": "pr_qk, token",
         "pr_qk_weight": "pr_qk, weight", "pr_k_weight": "PR_K, weight",
         "val_loss": "val loss (nats/char)"}
TRAJ_QUANTITIES = ("attn_entropy", "pr_qk_token", "pr_k_weight", "val_loss")
PAIRED_QUANTITIES = ("attn_entropy", "pr_qk_token", "pr_qk_weight", "val_loss")
EARLY_LINE = {**REF_LINE, "linestyle": ":"}


def _mean_ci(values: pd.Series) -> tuple[float, float, float]:
    v = values.to_numpy(dtype=float)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return np.nan, np.nan, np.nan
    m = float(v.mean())
    if len(v) < 2:
        return m, np.nan, np.nan
    half = float(sst.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v)))
    return m, m - half, m + half


def _early(ax, steps: int) -> None:
    if steps > 0:
        ax.axvline(EARLY_SHARE * steps, **EARLY_LINE)


def fig_e3_trajectories(series: pd.DataFrame, steps: int) -> Figure:
    """One panel per quantity of ``TRAJ_QUANTITIES``; see the module docstring."""
    with matplotlib.rc_context(STYLE):
        return _trajectories(series, steps)


def _trajectories(series: pd.DataFrame, steps: int) -> Figure:
    fig, axes = grid(1, len(TRAJ_QUANTITIES))
    modes = sorted(series["mode"].unique(), key=lambda m: (m != BASELINE, m))
    for ax, quantity in zip(axes[0], TRAJ_QUANTITIES, strict=True):
        sel = series[series["quantity"] == quantity]
        for mode in modes:
            g = sel[sel["mode"] == mode].groupby("step")["value"]
            if g.ngroups == 0:
                continue
            stat = pd.DataFrame([(s, *_mean_ci(v)) for s, v in g],
                                columns=["step", "mean", "lo", "hi"])
            ax.plot(stat["step"], stat["mean"], color=mode_color(mode), label=mode,
                    marker="o" if quantity == "val_loss" else None, markersize=2.5)
            if stat["lo"].notna().any():
                ax.fill_between(stat["step"], stat["lo"], stat["hi"], color=mode_color(mode),
                                alpha=0.15, linewidth=0)
        ax.set_title(SHORT[quantity])
        ax.set_xlabel("step")
        _early(ax, steps)
        step_axis(ax, steps)
    axes[0][0].legend(title="key control", frameon=False)
    suptitle(fig, "E3: training with key-spectrum control (seed mean ± 95 % CI)",
              len(TRAJ_QUANTITIES))
    return fig


def fig_e3_paired(paired: pd.DataFrame, steps: int) -> Figure:
    """Rows = controlled modes, columns = ``PAIRED_QUANTITIES``; see the module docstring."""
    with matplotlib.rc_context(STYLE):
        return _paired(paired, steps)


def _paired(paired: pd.DataFrame, steps: int) -> Figure:
    modes = sorted(paired["mode"].unique()) or ["hold"]
    fig, axes = grid(len(modes), len(PAIRED_QUANTITIES), sharex=True)
    for i, mode in enumerate(modes):
        for j, quantity in enumerate(PAIRED_QUANTITIES):
            ax = axes[i][j]
            sel = paired[(paired["mode"] == mode) & (paired["quantity"] == quantity)]
            for _, g in sel.groupby("seed"):
                ax.plot(g["step"], g["diff"], color=mode_color(mode), alpha=0.35, linewidth=0.7)
            if len(sel):
                mean = sel.groupby("step")["diff"].mean()
                ax.plot(mean.index, mean.to_numpy(), color=mode_color(mode), linewidth=1.8)
            ax.axhline(0.0, color="0.2", linewidth=0.6)
            _early(ax, steps)
            step_axis(ax, steps)
            if i == 0:
                ax.set_title(f"Δ {SHORT[quantity]}")
            if j == 0:
                ax.set_ylabel(f"{mode} − none")
            if i == len(modes) - 1:
                ax.set_xlabel("step")
    suptitle(fig, "E3: paired differences per seed (controlled − none)", len(PAIRED_QUANTITIES))
    return fig


def make_e3_figures(analysis: dict[str, pd.DataFrame], steps: int,
                    out_dir: str | Path) -> dict[str, Path]:
    """Both E3 figures into ``out_dir``; returns {name: PNG path}."""
    figs = {"e3_trajectories": fig_e3_trajectories(analysis["series"], steps),
            "e3_paired": fig_e3_paired(analysis["paired"], steps)}
    return {name: save_figure(fig, out_dir, name)[0] for name, fig in figs.items()}
