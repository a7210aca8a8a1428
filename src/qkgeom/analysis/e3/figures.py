"""Figures of E3 (key-spectrum control), house style of :mod:`qkgeom.analysis.figstyle`
(key-control modes in Okabe–Ito colours, weight-level arms dashed; a dotted line marks the
end of the early window): ``e3_trajectories``, whole-model quantities against step, one
line per arm with its seeds (:func:`~qkgeom.analysis.figstyle.draw_spread`), and
``e3_paired``, the paired differences (arm − none) per seed and their mean, a block of
panels per controlled arm.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pandas as pd
from matplotlib.figure import Figure

from qkgeom.analysis import figstyle
from qkgeom.analysis.e3.arms import BASELINE
from qkgeom.analysis.e3.paired import EARLY_SHARE
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
PAIRED_QUANTITIES = TRAJ_QUANTITIES


def _linestyle(arm: str) -> str:
    return "--" if "-weight-" in arm else "-"


def _early(ax, steps: int) -> None:
    if steps > 0:
        ax.axvline(EARLY_SHARE * steps, **figstyle.REF_LINE)


def seeds_per_arm(runs: pd.DataFrame) -> list[int]:
    """Seeds (runs) of each arm of ``runs`` (columns ``arm``, ``run_id``: the pair
    members, or their series): what decides thin lines or a t-band."""
    return [int(n) for n in runs.groupby("arm")["run_id"].nunique()] if len(runs) else []


def _rows(n: int) -> int:
    return -(-n // figstyle.MAX_COLS)


def fig_e3_trajectories(series: pd.DataFrame, steps: int) -> Figure:
    """One panel per quantity of ``TRAJ_QUANTITIES``, one line per arm (the seed mean with
    a 95 % t-band from 5 seeds on, one thin line per seed below); the legend in the first
    spare panel."""
    with matplotlib.rc_context(figstyle.STYLE):
        fig, axes = figstyle.grid(_rows(len(TRAJ_QUANTITIES)), figstyle.MAX_COLS)
        flat = list(axes.flat)
        arms = sorted(series["arm"].unique(), key=lambda m: (m != BASELINE, m))
        for ax, quantity in zip(flat, TRAJ_QUANTITIES, strict=False):
            sel = series[series["quantity"] == quantity].rename(columns={"run_id": "unit"})
            ax.set_title(SHORT[quantity])
            if sel.empty:
                figstyle.blank_panel(ax, "not recorded")
                continue
            for arm in arms:
                figstyle.draw_spread(ax, sel[sel["arm"] == arm], figstyle.mode_color(arm),
                                     label=arm, linestyle=_linestyle(arm),
                                     marker="o" if quantity == "val_loss" else None,
                                     markersize=2.5)
            ax.ticklabel_format(axis="y", useOffset=False)  # no "+2.548" corner label
            ax.set_xlabel("step")
            _early(ax, steps)
            figstyle.step_axis(ax, steps)
        spare = flat[len(TRAJ_QUANTITIES):]
        for ax in spare:
            ax.axis("off")
        handles, labels = flat[0].get_legend_handles_labels()
        if spare:
            spare[0].legend(handles, labels, title="arm", frameon=False, loc="center")
        else:
            flat[-1].legend(handles, labels, title="arm", frameon=False, loc="best")
        figstyle.suptitle(fig, "E3: training with key-spectrum control — "
                          f"{figstyle.spread_note(seeds_per_arm(series))}")
        return fig


def fig_e3_paired(paired: pd.DataFrame, steps: int) -> Figure:
    """Per controlled arm (against none) a block of panels, one per ``PAIRED_QUANTITIES``:
    one thin line per seed, the seed mean thick."""
    with matplotlib.rc_context(figstyle.STYLE):
        paired = paired[paired["baseline"] == BASELINE]
        arms = sorted(paired["arm"].unique()) or ["hold"]
        per_arm = _rows(len(PAIRED_QUANTITIES))
        fig, axes = figstyle.grid(len(arms) * per_arm, figstyle.MAX_COLS)
        for i, arm in enumerate(arms):
            block = list(axes[i * per_arm:(i + 1) * per_arm].flat)
            for ax in block[len(PAIRED_QUANTITIES):]:
                ax.axis("off")
            for j, quantity in enumerate(PAIRED_QUANTITIES):
                ax = block[j]
                sel = paired[(paired["arm"] == arm) & (paired["quantity"] == quantity)]
                ax.set_title(f"Δ {SHORT[quantity]}")  # the arm names the row (its y label)
                if j % figstyle.MAX_COLS == 0:
                    ax.set_ylabel(f"{arm} − none")
                if sel.empty:
                    figstyle.blank_panel(ax, "not recorded")
                    continue
                color = figstyle.mode_color(arm)
                for _, g in sel.groupby("group"):
                    ax.plot(g["step"], g["diff"], color=color, alpha=0.5, linewidth=0.7)
                mean = sel.groupby("step")["diff"].mean()
                ax.plot(mean.index, mean.to_numpy(), color=color, linewidth=1.8)
                ax.axhline(0.0, **figstyle.ZERO_LINE)
                _early(ax, steps)
                figstyle.step_axis(ax, steps)
                if j + figstyle.MAX_COLS >= len(PAIRED_QUANTITIES):  # none of this arm below
                    ax.set_xlabel("step")
        figstyle.suptitle(fig, "E3: paired differences per seed (arm − none)")
        return fig


def make_e3_figures(analysis: dict[str, pd.DataFrame], out_dir: str | Path) -> Drawn:
    """Both E3 figures of :func:`qkgeom.analysis.e3.e3_analysis`'s tables into
    ``out_dir``."""
    members = analysis["members"]
    steps = int(members["steps"].max()) if len(members) else 0
    series = analysis["series"].merge(members[["run_id", "arm"]], on="run_id")
    figs = {"e3_trajectories": fig_e3_trajectories(series, steps),
            "e3_paired": fig_e3_paired(analysis["paired"], steps)}
    return Drawn({name: figstyle.save_figure(fig, out_dir, name)[0]
                  for name, fig in figs.items()},
                 spread=figstyle.spread_note(seeds_per_arm(members)))
