"""The learning-rate sweep per remedy (docs/stability.md#claims-and-statistics): LR
sensitivity (Wortsman et al., 2023), the widest stable range and the best rate.

Each run's loss enters *clipped*: min(L(η), L₀), a diverged run at L₀, where L₀ is the
val loss at step 0 of its seed and remedy (the same at every rate: no update has run).
Clipping keeps one diverged run from weighing more than "learned nothing".
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from qkgeom.analysis.stability.outcomes import StabilityRuns

SENSITIVITY_COLUMNS = ["size", "arm", "seed", "rates", "initial_val_loss", "best_loss",
                       "sensitivity"]
RANGE_COLUMNS = ["size", "arm", "rates", "stable_rates", "range_low", "range_high",
                 "range_decades", "best_lr", "best_median_loss"]


def clipped_losses(stab: StabilityRuns) -> pd.DataFrame:
    """``size, arm, lr, seed, L0, clipped``: each run's min(final val loss, L₀), a diverged
    run at L₀; L₀ the median over the rates of the seed and arm's step-0 val loss. NaN
    where a done run has no final val loss or the seed has no L₀."""
    runs = stab.runs.copy()
    l0 = runs.groupby(["size", "arm", "seed"])["initial_val_loss"].transform("median")
    loss = runs["final_val_loss"].astype(float)
    clipped = np.where(runs["state"] == "diverged", l0, np.fmin(loss, l0))
    clipped = np.where(np.isnan(l0) | ((runs["state"] != "diverged") & loss.isna()),
                       np.nan, clipped)
    return runs[["size", "arm", "lr", "seed"]].assign(L0=l0, clipped=clipped)


def lr_sensitivity(stab: StabilityRuns) -> pd.DataFrame:
    """Per size, arm and seed (:data:`SENSITIVITY_COLUMNS`): LS = mean over the sweep's
    rates of [clipped loss − the smallest clipped loss over the rates]. NaN when the seed
    lacks a run (or a loss) at any rate of its size's sweep."""
    c = clipped_losses(stab)
    rates = {size: sorted(g["lr"].unique()) for size, g in c.groupby("size")}
    rows = []
    for (size, arm, seed), g in c.groupby(["size", "arm", "seed"], sort=False):
        sweep = rates[size]
        values = [g.loc[np.isclose(g["lr"], lr), "clipped"] for lr in sweep]
        ok = all(len(v) == 1 and np.isfinite(v.iloc[0]) for v in values)
        x = np.array([float(v.iloc[0]) for v in values]) if ok else np.array([])
        rows.append({"size": size, "arm": arm, "seed": int(seed), "rates": len(sweep),
                     "initial_val_loss": float(g["L0"].iloc[0]),
                     "best_loss": float(x.min()) if ok else np.nan,
                     "sensitivity": float(np.mean(x - x.min())) if ok else np.nan})
    return pd.DataFrame(rows, columns=SENSITIVITY_COLUMNS)


def widest_stable_range(lrs: list[float], stable: list[bool]) -> tuple[float, float]:
    """The longest run of consecutive rates (sorted ascending) that are all stable, as its
    end rates; of two equally long runs the one at the higher rates; ``(nan, nan)`` when no
    rate is stable."""
    best: tuple[int, int] | None = None
    start = None
    for i, ok in enumerate([*stable, False]):
        if ok and start is None:
            start = i
        elif not ok and start is not None:
            if best is None or i - start >= best[1] - best[0]:
                best = (start, i)
            start = None
    if best is None:
        return (math.nan, math.nan)
    return (float(lrs[best[0]]), float(lrs[best[1] - 1]))


def rate_table(stab: StabilityRuns) -> pd.DataFrame:
    """Per size and remedy (:data:`RANGE_COLUMNS`): the sweep's rates, those at which no
    seed collapsed or diverged, the widest stable range (end rates, width in decades) and
    the best rate (lowest median clipped loss over seeds)."""
    c = clipped_losses(stab)
    rows = []
    for (size, arm), g in stab.runs.groupby(["size", "arm"], sort=False):
        lrs = sorted(g["lr"].unique())
        ok = [bool(len(r := g[np.isclose(g["lr"], lr)])) and not r["collapsed"].any()
              for lr in lrs]
        low, high = widest_stable_range(lrs, ok)
        mine = c[(c["size"] == size) & (c["arm"] == arm)]
        med = mine.groupby("lr")["clipped"].median().dropna()
        rows.append({"size": size, "arm": arm, "rates": len(lrs), "stable_rates": sum(ok),
                     "range_low": low, "range_high": high,
                     "range_decades": math.log10(high / low) if np.isfinite(low) else np.nan,
                     "best_lr": float(med.idxmin()) if len(med) else np.nan,
                     "best_median_loss": float(med.min()) if len(med) else np.nan})
    return pd.DataFrame(rows, columns=RANGE_COLUMNS)
