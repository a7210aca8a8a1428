"""The stability figure (docs/stability.md#figure): per remedy (columns), the layer-minimum
attention entropy and the largest layer max logit against step, one colour per learning
rate, each seed a thin line and their median bold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.analysis import figstyle
from qkgeom.analysis.stability.outcomes import COLLAPSE_NATS, StabilityRuns, layer_table

NAME = "stability_trajectories"
#: (metric, how the layers are reduced, y label, log scale)
ROWS = (("attn_entropy", "min", "min over layers of\nattention entropy (nats)", False),
        ("logit_max", "max", "max over layers of\nmax scaled logit", True))


def draw(stab: StabilityRuns, out: Path) -> Path:
    """Draw and save the figure; returns its PNG."""
    arms = list(dict.fromkeys(stab.runs["arm"]))
    lrs = sorted(stab.runs["lr"].unique())
    colors = figstyle.layer_colors(len(lrs))
    fig, axes = figstyle.grid(len(ROWS), len(arms), sharex=True, sharey="row")
    for i, (metric, how, label, log) in enumerate(ROWS):
        t = layer_table(stab, metric)
        per_run = t.groupby(["run_id", "step"])["value"].agg(how).reset_index()
        for j, arm in enumerate(arms):
            ax = axes[i, j]
            for lr, color in zip(lrs, colors, strict=True):
                ids = stab.runs[(stab.runs["arm"] == arm) & np.isclose(stab.runs["lr"], lr)]
                _draw_runs(ax, per_run[per_run["run_id"].isin(ids["run_id"])], color,
                           f"lr {lr:g}", log)
            if metric == "attn_entropy":
                ax.axhline(COLLAPSE_NATS, **figstyle.REF_LINE)
            if log:
                ax.set_yscale("log")
            if i == 0:
                ax.set_title(arm)
            if j == 0:
                ax.set_ylabel(label)
            figstyle.step_axis(ax, float(stab.runs["steps"].max()))
            if i == len(ROWS) - 1:
                ax.set_xlabel("step")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(lrs), frameon=False)
    figstyle.suptitle(fig, f"{stab.name}: attention entropy and max logit per remedy "
                      f"(thin: each seed; bold: median; dotted: collapse at "
                      f"{COLLAPSE_NATS:g} nats)")
    return figstyle.save_figure(fig, out, NAME)[0]


def _draw_runs(ax, runs: pd.DataFrame, color, label: str, log: bool) -> None:
    """Each run thin, the median over runs at each step bold (labelled once)."""
    if runs.empty:
        return
    values = runs["value"].where(runs["value"] > 0) if log else runs["value"]
    runs = runs.assign(value=values)
    for _, g in runs.groupby("run_id"):
        ax.plot(g["step"], g["value"], color=color, linewidth=figstyle.SEED_LINEWIDTH,
                alpha=0.45)
    median = runs.groupby("step")["value"].median()
    ax.plot(median.index, median.to_numpy(), color=color, linewidth=1.6, label=label)
