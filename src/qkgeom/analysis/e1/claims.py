"""The E1 and E2 claims, each decided over independent runs (docs/protocols.md).

Every claim is a predicted sign of one statistic (:mod:`.trajectories`); the unit is the
run (each has its own seed), its value the mean over its layers. Beside it: the same test
over depth × init cells and the count of seed-averaged layer trajectories (the paper's
unit, not independent: no p). Each claim has one primary row (:data:`PRIMARY`), declared
before any run; the six primary rows are Holm-adjusted together, the others are secondary:
the other levels and origins, E2's within-run ρ without its cross-run null (protocol 1's
primary) and, per layer index, the primary statistic (protocol 2). E1.3 is read four ways
(:func:`contrast_readings`); why (c): docs/protocols.md#e13-four-readings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.collate import GROUP
from qkgeom.analysis.e1.trajectories import LEVELS, NULL_STATS, ORIGINS, cell_stats, run_stats
from qkgeom.analysis.kit import CLAIM_COLUMNS, claim_row, decide, fmt_p, with_ci


@dataclass(frozen=True)
class Claim:
    """One claim: the statistic whose sign is counted, and how to describe it."""

    id: str
    text: str
    statistic: str
    sign: int  # predicted sign of ``statistic``
    criterion: str  # what one run must show, in words
    secondary: str | None = None  # a second statistic whose run count is shown beside
    secondary_criterion: str = ""
    mean_label: str = "mean"
    universal: bool = False  # "in all trajectories": every layer trajectory must agree
    per_origin: bool = True  # False: measured at the last checkpoint only
    #: Further statistics of the claim, each a secondary row at every level and origin:
    #: (statistic, criterion, mean label).
    also: tuple[tuple[str, str, str], ...] = ()


CLAIMS = (
    Claim("E1.1", "PR_Q expands", "delta_pr_q", +1, "ΔPR_Q > 0 (last probe − origin)",
          "slope_pr_q", "OLS slope > 0", "mean ΔPR_Q"),
    Claim("E1.2", "PR_K shrinks", "delta_pr_k", -1, "ΔPR_K < 0 (last probe − origin)",
          "slope_pr_k", "OLS slope < 0", "mean ΔPR_K"),
    Claim("E1.3", "PR_Q − PR_K > 0 in all trajectories", "contrast_time_mean", +1,
          "(c) time-averaged PR_Q − PR_K after the origin > 0",
          mean_label="mean time-averaged PR_Q − PR_K", universal=True),
    Claim("E2.1", "Key shrinkage goes with a narrower QKᵀ spectrum", "rho_k_qk_vs_null", +1,
          "Spearman ρ of the probe-to-probe changes of PR_K and of pr_qk within the run, "
          "minus the mean cross-run ρ (run's ΔPR_K, other run's Δpr_qk) > 0",
          mean_label="mean ρ within − cross-run",
          also=(("rho_k_qk", "within-run Spearman ρ of the changes of PR_K and pr_qk > 0 "
                 "(no null; protocol 1's primary)", "mean ρ within run, no null"),)),
    Claim("E2.2", "A narrower QKᵀ spectrum goes with more peaked attention",
          "rho_qk_entropy_vs_null", +1,
          "Spearman ρ of the probe-to-probe changes of pr_qk and of attention entropy within "
          "the run, minus the mean cross-run ρ > 0", mean_label="mean ρ within − cross-run",
          also=(("rho_qk_entropy", "within-run Spearman ρ of the changes of pr_qk and "
                 "attention entropy > 0 (no null; protocol 1's primary)",
                 "mean ρ within run, no null"),)),
    Claim("E2.3", "Across heads, a narrower QKᵀ spectrum goes with more peaked attention",
          "rho_heads_qk_entropy", +1,
          "Spearman ρ across the layer's heads of pr_qk with attention entropy > 0 (last "
          "checkpoint)", mean_label="mean ρ", per_origin=False),
)

#: E1.3's readings: (label, statistic, what a layer must show). (c) is the primary.
READINGS = (
    ("a", "contrast_min_after", "positive at every probe after the origin"),
    ("b", "contrast_end", "positive at the last probe"),
    ("c", "contrast_time_mean", "positive on average after the origin (time average)"),
    ("d", "delta_contrast", "ΔPR_Q − ΔPR_K > 0 from the origin"),
)
PRIMARY_READING = "c"
UNIT = "runs"
#: The primary (level, origin) of every claim; E2.3 is read at the last checkpoint only.
PRIMARY = ("token", "reference")
#: E1's claims.csv: the shared columns, then the statistic a row tests and its layer index
#: (NaN: the run's mean over its layers; a number: the per-layer row of that layer).
E1_CLAIM_COLUMNS = [*CLAIM_COLUMNS, "statistic", "layer"]
#: Why a row of E2's null measured no run when the within-run ρ did.
NO_NULL = "no other run of its depth and setting to pair with (the cross-run null needs two)"


def _origin_label(sel: pd.DataFrame, origin: str) -> str:
    starts = sorted(int(s) for s in sel["start_step"].dropna().unique()) \
        if "start_step" in sel else []
    if not starts:
        return "step 0" if origin == "step0" else "reference"
    span = f"step {starts[0]}" if len(starts) == 1 else f"steps {starts[0]}–{starts[-1]}"
    return span if origin == "step0" else f"reference, {span}"


def _selector(per_layer_runs: pd.DataFrame, traj: pd.DataFrame
              ) -> Callable[[str, str], list[pd.DataFrame]]:
    """The run, cell and trajectory statistics split once by (level, origin), as claims
    read them 22 times: a function of (level, origin) giving the three frames."""
    runs = run_stats(per_layer_runs)
    parts = [({} if f.empty else dict(tuple(f.groupby(["level", "origin"], sort=False))),
              f.iloc[0:0]) for f in (runs, cell_stats(runs), traj)]
    return lambda level, origin: [groups.get((level, origin), empty) for groups, empty in parts]


def _values(frame: pd.DataFrame, statistic: str) -> pd.Series:
    return frame[statistic] if statistic in frame else pd.Series([], dtype=float)


def _three_units(statistic: str, sign: int, runs: pd.DataFrame, cells: pd.DataFrame,
                 traj: pd.DataFrame) -> tuple[dict, dict, dict]:
    """The run test (the verdict's), the cell test and the trajectory count of one
    statistic on already-selected rows."""
    return (stats.unit_test(_values(runs, statistic), sign),
            stats.unit_test(_values(cells, statistic), sign),
            stats.count_test(_values(traj, statistic), sign))


def _claim_row(claim: Claim, statistic: str, criterion: str, mean_label: str, level: str,
               origin: str, frames: list[pd.DataFrame], primary: bool,
               layer: float = np.nan) -> dict:
    """One claims row of ``statistic`` over the selected run, cell and trajectory rows."""
    r_sel, c_sel, t_sel = frames
    ru, cu, tu = _three_units(statistic, claim.sign, r_sel, c_sel, t_sel)
    beside = (f"cells {cu['k']}/{cu['n']} (p {fmt_p(cu['p_value'])}); layer "
              f"trajectories {tu['k']}/{tu['n']}")
    if claim.secondary and statistic == claim.statistic:
        sc = stats.count_test(_values(r_sel, claim.secondary), claim.sign)
        beside += f"; {claim.secondary_criterion}: {sc['k']}/{sc['n']} runs"
    reason = ""
    within = statistic.removesuffix("_vs_null")
    if statistic in NULL_STATS and ru["n"] == 0 and len(stats.finite(_values(r_sel, within))):
        reason = NO_NULL  # the within-run ρ was measured, the null had no pairs
    frm = _origin_label(r_sel, origin) if claim.per_origin else "last checkpoint"
    return claim_row(
        claim.id, claim.text, level, ru, role="primary" if primary else "secondary",
        unit=UNIT, measured=f"{ru['k']}/{ru['n']} {UNIT}",
        estimate=f"{mean_label} {with_ci(ru['mean'], ru['ci_low'], ru['ci_high'])}",
        test=stats.TEST_FLIP, beside=beside, reason=reason,
        universal_ok=(tu["k"] == tu["n"]) if claim.universal else None, criterion=criterion,
        origin=origin if claim.per_origin else "last", statistic=statistic, layer=layer,
        **{"from": frm if np.isnan(layer) else f"{frm} · layer {int(layer)}"})


def _per_layer(per_layer_runs: pd.DataFrame, traj: pd.DataFrame, level: str, origin: str
               ) -> dict[int, list[pd.DataFrame]]:
    """Per layer index: its run rows, the cell means of those and its trajectories at
    ``level`` and ``origin`` (a run's "value" for the layer is that layer's statistic)."""
    def pick(f: pd.DataFrame) -> pd.DataFrame:
        return f[(f["level"] == level) & (f["origin"] == origin)] if len(f) else f
    runs, tr = pick(per_layer_runs), pick(traj)
    out = {}
    for layer, r in (runs.groupby("layer", sort=True) if len(runs) else ()):
        cells = r.groupby(GROUP, sort=True, dropna=False).mean(numeric_only=True)
        out[int(layer)] = [r, cells, tr[tr["layer"] == layer]]
    return out


def evaluate_claims(per_layer_runs: pd.DataFrame, traj: pd.DataFrame) -> pd.DataFrame:
    """The E1/E2 claims table from the per-run-and-layer and the seed-averaged statistics
    of :func:`qkgeom.analysis.e1.trajectories.layer_statistics`.

    One row per claim × level × origin (E2.3, measured at the last checkpoint only: one row
    per level, origin ``last``), one per further statistic of a claim (``also``) × level ×
    origin, and one per claim × layer index at the primary level and origin (``layer``),
    in :data:`E1_CLAIM_COLUMNS`."""
    select = _selector(per_layer_runs, traj)
    rows = []
    for claim in CLAIMS:
        for level in LEVELS:
            for origin in ORIGINS if claim.per_origin else ("step0",):
                frames = select(level, origin)
                primary = level == PRIMARY[0] and (origin == PRIMARY[1] or not claim.per_origin)
                rows.append(_claim_row(claim, claim.statistic, claim.criterion,
                                       claim.mean_label, level, origin, frames, primary))
                rows += [_claim_row(claim, stat, crit, label, level, origin, frames, False)
                         for stat, crit, label in claim.also]
    for claim in CLAIMS:
        origin = PRIMARY[1] if claim.per_origin else "step0"
        for layer, frames in _per_layer(per_layer_runs, traj, PRIMARY[0], origin).items():
            rows.append(_claim_row(claim, claim.statistic, f"{claim.criterion}; layer {layer}",
                                   claim.mean_label, PRIMARY[0], origin, frames, False,
                                   layer=float(layer)))
    claims = pd.DataFrame(rows)
    main = claims["claim_id"].map({c.id: c.statistic for c in CLAIMS})
    # each claim: its primary row, its other rows of the same statistic, its further
    # statistics (``also``), then its per-layer rows
    order = (claims["role"].ne("primary").astype(int) + 2 * claims["statistic"].ne(main)
             + 4 * claims["layer"].notna())
    claims = claims.assign(_o=order).sort_values(["claim_id", "_o"], kind="stable")
    return decide(claims.drop(columns="_o"), holm_primary=True)[E1_CLAIM_COLUMNS] \
        .reset_index(drop=True)


def layer_mean_rows(claims: pd.DataFrame) -> pd.DataFrame:
    """The rows of the run-level value (the mean over layers), without the per-layer rows."""
    return claims[claims["layer"].isna()] if "layer" in claims else claims


def per_layer_rows(claims: pd.DataFrame) -> pd.DataFrame:
    """The per-layer rows (secondary; protocol 2)."""
    return claims[claims["layer"].notna()] if "layer" in claims else claims.iloc[0:0]


def contrast_readings(per_layer_runs: pd.DataFrame, traj: pd.DataFrame) -> pd.DataFrame:
    """E1.3 read four ways, side by side: one row per reading × level × origin with the run
    test (``k, n, mean, ci_low, ci_high, p_value, p_sign``), the cell test (``cells_k,
    cells_n, cells_p``), the layer-trajectory count (``traj_k, traj_n``), ``primary`` and
    the verdict the reading would get as a universal claim."""
    select = _selector(per_layer_runs, traj)
    rows = []
    for label, statistic, text in READINGS:
        for level in LEVELS:
            for origin in ORIGINS:
                ru, cu, tu = _three_units(statistic, +1, *select(level, origin))
                rows.append({
                    "reading": label, "statistic": statistic, "criterion": text,
                    "primary": label == PRIMARY_READING, "level": level, "origin": origin,
                    **{k: ru[k] for k in ("k", "n", "mean", "ci_low", "ci_high", "p_value",
                                          "p_sign")},
                    "cells_k": cu["k"], "cells_n": cu["n"], "cells_p": cu["p_value"],
                    "traj_k": tu["k"], "traj_n": tu["n"],
                    "verdict": stats.verdict(ru["k"], ru["n"], ru["p_value"],
                                             p_opposite=ru["p_opposite"],
                                             universal_ok=tu["k"] == tu["n"]),
                })
    return pd.DataFrame(rows)


#: The reference-sensitivity table's claims: (claim id, statistic, predicted sign).
SENSITIVITY_CLAIMS = (("E1.1", "delta_pr_q", +1), ("E1.2", "delta_pr_k", -1))


def sensitivity_summary(per_run: pd.DataFrame) -> pd.DataFrame:
    """The reference-sensitivity table (secondary, descriptive; docs/protocols.md#reference-
    sensitivity) from :func:`~qkgeom.analysis.e1.trajectories.reference_sensitivity`'s
    per-run rows: one row per setting (``variant``), level, reference step and claim with
    the run test at that reference (``k, n, mean, ci_low, ci_high``, the unadjusted
    one-sided ``p_value`` and ``p_opposite``), ``share`` of the run and ``primary``."""
    cols = ["variant", "level", "reference_step", "share", "primary", "claim_id", "statistic",
            "k", "n", "mean", "ci_low", "ci_high", "p_value", "p_opposite"]
    if per_run.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    keys = ["variant", "level", "reference_step"]
    for (variant, level, step), g in per_run.groupby(keys, sort=True):
        for claim_id, statistic, sign in SENSITIVITY_CLAIMS:
            u = stats.unit_test(g[statistic], sign)
            rows.append({"variant": variant, "level": level, "reference_step": int(step),
                         "share": float(g["share"].mean()), "primary": bool(g["primary"].any()),
                         "claim_id": claim_id, "statistic": statistic,
                         **{c: u[c] for c in cols[7:]}})
    return pd.DataFrame(rows, columns=cols)
