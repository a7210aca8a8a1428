"""The stability figures (docs/stability.md#figures): the final val loss against the
learning rate per remedy, and per remedy (columns; per size for a sweep of one remedy)
the layer-minimum attention entropy and the largest layer max logit against step, one
colour per learning rate, each seed a thin line and their median bold."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.analysis import figstyle
from qkgeom.analysis.stability.outcomes import (
    COLLAPSE_NATS,
    NONE,
    StabilityRuns,
    layer_table,
)
from qkgeom.analysis.stability.sensitivity import clipped_losses

NAME = "stability_trajectories"
SWEEP_NAME = "stability_lr_sweep"
#: (metric, how the layers are reduced, y label, log scale)
ROWS = (("attn_entropy", "min", "min over layers of\nattention entropy (nats)", False),
        ("logit_max", "max", "max over layers of\nmax scaled logit", True))


def draw_lr_sweep(stab: StabilityRuns, out: Path) -> Path:
    """Final val loss (clipped at L₀; a diverged run a cross on the top edge, the y range
    that of the runs that did not diverge) against the learning rate, one panel per
    remedy (and size), each seed thin, the median bold, ``none``'s median grey in every
    panel. Returns the PNG."""
    c = clipped_losses(stab).merge(stab.runs[["size", "arm", "lr", "seed", "state"]],
                                   on=["size", "arm", "lr", "seed"])
    panels = [(size, arm) for size in stab.sizes for arm in dict.fromkeys(stab.runs["arm"])
              if ((c["size"] == size) & (c["arm"] == arm)).any()]
    cols = min(figstyle.MAX_COLS, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = figstyle.grid(nrows, cols, sharex=True, sharey=True)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    # the y range of the runs that did not diverge: a diverged run at L₀ (6.3 nats for a
    # char-level model) would squash the remedies' differences, a few tenths of a nat
    kept = c.loc[c["state"] != "diverged", "clipped"].dropna()
    top = float(kept.max()) if len(kept) else None
    if top is not None:
        low = float(kept.min())
        pad = 0.05 * max(top - low, 0.1)
        axes.flat[0].set_ylim(low - pad, top + pad)  # shared by every panel
    for ax, (size, arm) in zip(axes.flat, panels, strict=False):
        mine = c[(c["size"] == size) & (c["arm"] == arm)]
        base = c[(c["size"] == size) & (c["arm"] == NONE)]
        if arm != NONE and len(base):
            med = base.groupby("lr")["clipped"].median()
            ax.plot(med.index, med.to_numpy(), color="0.6", linewidth=1.4, label="none (median)")
        for _, g in mine.groupby("seed"):
            g = g.sort_values("lr")
            ax.plot(g["lr"], g["clipped"], color="#0072B2", alpha=0.45,
                    linewidth=figstyle.SEED_LINEWIDTH)
        gone = mine[mine["state"] == "diverged"]
        if len(gone):  # on the top edge when L₀ is above the axis
            at = gone["clipped"] if top is None else np.minimum(gone["clipped"], ax.get_ylim()[1])
            ax.plot(gone["lr"], at, "x", color="#D55E00", markersize=6, clip_on=False,
                    label="diverged (loss L₀, drawn on the top edge)")
        med = mine.groupby("lr")["clipped"].median()
        ax.plot(med.index, med.to_numpy(), color="#0072B2", linewidth=1.8, marker="o",
                markersize=3, label="median over seeds")
        ax.set_xscale("log")
        ax.set_title(arm if len(stab.sizes) == 1 else f"{arm}, {size}")
    for ax in axes[-1, :]:
        ax.set_xlabel("learning rate")
    for ax in axes[:, 0]:
        ax.set_ylabel("final val loss (nats)")
    handles: dict[str, object] = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center",
               ncol=max(min(len(handles), cols), 1), frameon=False)
    figstyle.suptitle(fig, f"{stab.name}: final val loss against the learning rate per "
                      "remedy (thin: each seed; bold: median; grey: none)")
    return figstyle.save_figure(fig, out, SWEEP_NAME)[0]


def draw(stab: StabilityRuns, out: Path) -> Path:
    """Draw and save the figure; returns its PNG."""
    by = "arm" if stab.runs["arm"].nunique() > 1 or len(stab.sizes) == 1 else "size"
    arms = list(dict.fromkeys(stab.runs[by]))
    lrs = sorted(stab.runs["lr"].unique())
    colors = figstyle.layer_colors(len(lrs))
    fig, axes = figstyle.grid(len(ROWS), len(arms), sharex=True, sharey="row")
    for i, (metric, how, label, log) in enumerate(ROWS):
        t = layer_table(stab, metric)
        per_run = t.groupby(["run_id", "step"])["value"].agg(how).reset_index()
        for j, arm in enumerate(arms):
            ax = axes[i, j]
            for lr, color in zip(lrs, colors, strict=True):
                ids = stab.runs[(stab.runs[by] == arm) & np.isclose(stab.runs["lr"], lr)]
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
    figstyle.suptitle(fig, f"{stab.name}: attention entropy and max logit per {by} "
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
