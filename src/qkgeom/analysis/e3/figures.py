"""Figures of E3 (key-spectrum control): trajectories per arm and paired differences.

House style of :mod:`qkgeom.analysis.figstyle` (at most three panels across, 9 pt text,
PNG 150 dpi + SVG, key-control modes in Okabe–Ito colours, weight-level arms dashed). A
dotted vertical line marks the end of the early window (25 % of the run).

- ``e3_trajectories``: attention entropy, the logit scale, pr_qk (token), PR_K (weight) and
  validation loss against step, whole-model (layer mean), one line per arm: the seed mean
  with a 95 % t-band from 5 seeds on, one thin line per seed below
  (:func:`~qkgeom.analysis.figstyle.draw_spread`); two rows of three panels, the arms'
  legend in the sixth.
- ``e3_paired``: the paired differences (arm − none) per seed against step, one thin line
  per seed and the seed mean thick; per controlled arm a block of two rows of panels (the
  quantities, three across), titled with the arm.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pandas as pd
from matplotlib.figure import Figure

from qkgeom.analysis.e3.arms import BASELINE
from qkgeom.analysis.e3.paired import EARLY_SHARE
from qkgeom.analysis.figstyle import (
    MAX_COLS,
    REF_LINE,
    STYLE,
    ZERO_LINE,
    blank_panel,
    draw_spread,
    grid,
    mode_color,
    save_figure,
    spread_note,
    step_axis,
    suptitle,
)
from qkgeom.analysis.kit import Drawn

# Short panel titles (the long labels are in qkgeom.analysis.e3.paired.QUANTITIES).
SHORT = {"attn_entropy": "attention entropy (nats)",
         "attn_entropy_scalefree": "scale-free entropy (nats)",
         "logit_std_row": "within-row logit scale", "logit_std": "logit scale (std)",
         "pr_qk_token": "pr_qk, token", "pr_qk_weight": "pr_qk, weight",
         "pr_k_token": "PR_K, token", "pr_k_weight": "PR_K, weight",
         "val_loss": "val loss (nats/char)"}
TRAJ_QUANTITIES = ("attn_entropy_scalefree", "attn_entropy", "logit_std_row", "pr_qk_token",
                   "pr_k_token", "val_loss")
PAIRED_QUANTITIES = ("attn_entropy_scalefree", "attn_entropy", "logit_std_row", "pr_qk_token",
                     "pr_k_token", "val_loss")


def _linestyle(arm: str) -> str:
    return "--" if "-weight-" in arm else "-"


def _early(ax, steps: int) -> None:
    if steps > 0:
        ax.axvline(EARLY_SHARE * steps, **REF_LINE)


def fig_e3_trajectories(series: pd.DataFrame, steps: int) -> Figure:
    """One panel per quantity of ``TRAJ_QUANTITIES``; see the module docstring."""
    with matplotlib.rc_context(STYLE):
        return _trajectories(series, steps)


def seeds_per_arm(runs: pd.DataFrame) -> list[int]:
    """Seeds (runs) of each arm of ``runs`` (columns ``arm``, ``run_id``: the pair
    members, or their series): what decides thin lines or a t-band."""
    return [int(n) for n in runs.groupby("arm")["run_id"].nunique()] if len(runs) else []


def _rows(n: int) -> int:
    return -(-n // MAX_COLS)


def _trajectories(series: pd.DataFrame, steps: int) -> Figure:
    fig, axes = grid(_rows(len(TRAJ_QUANTITIES)), MAX_COLS)
    flat = list(axes.flat)
    arms = sorted(series["arm"].unique(), key=lambda m: (m != BASELINE, m))
    for ax, quantity in zip(flat, TRAJ_QUANTITIES, strict=False):
        sel = series[series["quantity"] == quantity].rename(columns={"run_id": "unit"})
        ax.set_title(SHORT[quantity])
        if sel.empty:
            blank_panel(ax, "not recorded")
            continue
        for arm in arms:
            draw_spread(ax, sel[sel["arm"] == arm], mode_color(arm), label=arm,
                        linestyle=_linestyle(arm),
                        marker="o" if quantity == "val_loss" else None, markersize=2.5)
        ax.ticklabel_format(axis="y", useOffset=False)  # no "+2.548" corner label
        ax.set_xlabel("step")
        _early(ax, steps)
        step_axis(ax, steps)
    for ax in flat[len(TRAJ_QUANTITIES):]:
        ax.axis("off")
    handles, labels = flat[0].get_legend_handles_labels()
    spare = flat[len(TRAJ_QUANTITIES):]
    if spare:  # the legend in the first empty panel
        spare[0].legend(handles, labels, title="arm", frameon=False, loc="center")
    else:
        flat[-1].legend(handles, labels, title="arm", frameon=False, loc="best")
    suptitle(fig, "E3: training with key-spectrum control — "
             f"{spread_note(seeds_per_arm(series))}")
    return fig


def fig_e3_paired(paired: pd.DataFrame, steps: int) -> Figure:
    """Rows = controlled arms (against none), columns = ``PAIRED_QUANTITIES``; see the
    module docstring."""
    with matplotlib.rc_context(STYLE):
        return _paired(paired, steps)


def _paired(paired: pd.DataFrame, steps: int) -> Figure:
    paired = paired[paired["baseline"] == BASELINE]
    arms = sorted(paired["arm"].unique()) or ["hold"]
    per_arm = _rows(len(PAIRED_QUANTITIES))
    fig, axes = grid(len(arms) * per_arm, MAX_COLS)
    for i, arm in enumerate(arms):
        block = list(axes[i * per_arm:(i + 1) * per_arm].flat)
        for ax in block[len(PAIRED_QUANTITIES):]:
            ax.axis("off")
        for j, quantity in enumerate(PAIRED_QUANTITIES):
            ax = block[j]
            sel = paired[(paired["arm"] == arm) & (paired["quantity"] == quantity)]
            ax.set_title(f"Δ {SHORT[quantity]}")  # the arm names the row (its y label)
            if j % MAX_COLS == 0:
                ax.set_ylabel(f"{arm} − none")
            if sel.empty:
                blank_panel(ax, "not recorded")
                continue
            for _, g in sel.groupby("group"):
                ax.plot(g["step"], g["diff"], color=mode_color(arm), alpha=0.5, linewidth=0.7)
            mean = sel.groupby("step")["diff"].mean()
            ax.plot(mean.index, mean.to_numpy(), color=mode_color(arm), linewidth=1.8)
            ax.axhline(0.0, **ZERO_LINE)
            _early(ax, steps)
            step_axis(ax, steps)
            if j + MAX_COLS >= len(PAIRED_QUANTITIES):  # no panel of this arm below
                ax.set_xlabel("step")
    suptitle(fig, "E3: paired differences per seed (arm − none)")
    return fig


def make_e3_figures(analysis: dict[str, pd.DataFrame], out_dir: str | Path) -> Drawn:
    """Both E3 figures of :func:`qkgeom.analysis.e3.e3_analysis`'s tables into
    ``out_dir``."""
    members = analysis["members"]
    steps = int(members["steps"].max()) if len(members) else 0
    series = analysis["series"].merge(members[["run_id", "arm"]], on="run_id")
    figs = {"e3_trajectories": fig_e3_trajectories(series, steps),
            "e3_paired": fig_e3_paired(analysis["paired"], steps)}
    return Drawn({name: save_figure(fig, out_dir, name)[0] for name, fig in figs.items()},
                 spread=spread_note(seeds_per_arm(members)))
