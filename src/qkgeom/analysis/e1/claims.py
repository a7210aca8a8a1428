"""The E1 and E2 claims, each decided over independent runs (docs/protocols.md).

Every claim is a predicted sign of one statistic (:mod:`.trajectories`); the unit is the
run (each has its own seed), its value the mean over its layers. Beside it: the same test
over depth × init cells and the count of seed-averaged layer trajectories (the paper's
unit, not independent: no p). Each claim has one primary row (:data:`PRIMARY`), declared
before any run; the six primary rows are Holm-adjusted together, the others are secondary.
E1.3 is read four ways (:func:`contrast_readings`); why (c): docs/protocols.md#e13-four-readings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.e1.trajectories import LEVELS, ORIGINS, cell_stats, run_stats
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


CLAIMS = (
    Claim("E1.1", "PR_Q expands", "delta_pr_q", +1, "ΔPR_Q > 0 (last probe − origin)",
          "slope_pr_q", "OLS slope > 0", "mean ΔPR_Q"),
    Claim("E1.2", "PR_K shrinks", "delta_pr_k", -1, "ΔPR_K < 0 (last probe − origin)",
          "slope_pr_k", "OLS slope < 0", "mean ΔPR_K"),
    Claim("E1.3", "PR_Q − PR_K > 0 in all trajectories", "contrast_time_mean", +1,
          "(c) time-averaged PR_Q − PR_K after the origin > 0",
          mean_label="mean time-averaged PR_Q − PR_K", universal=True),
    Claim("E2.1", "Key shrinkage goes with a narrower QKᵀ spectrum", "rho_k_qk", +1,
          "Spearman ρ of the probe-to-probe changes of PR_K and of pr_qk > 0",
          mean_label="mean ρ"),
    Claim("E2.2", "A narrower QKᵀ spectrum goes with more peaked attention", "rho_qk_entropy",
          +1, "Spearman ρ of the probe-to-probe changes of pr_qk and of attention entropy > 0",
          mean_label="mean ρ"),
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


def evaluate_claims(per_layer_runs: pd.DataFrame, traj: pd.DataFrame) -> pd.DataFrame:
    """The E1/E2 claims table from the per-run-and-layer and the seed-averaged statistics
    of :func:`qkgeom.analysis.e1.trajectories.layer_statistics`.

    One row per claim × level × origin (E2.3, measured at the last checkpoint only: one row
    per level, origin ``last``), in :data:`qkgeom.analysis.kit.CLAIM_COLUMNS`."""
    select = _selector(per_layer_runs, traj)
    rows = []
    for claim in CLAIMS:
        for level in LEVELS:
            for origin in ORIGINS if claim.per_origin else ("step0",):
                r_sel, c_sel, t_sel = select(level, origin)
                ru, cu, tu = _three_units(claim.statistic, claim.sign, r_sel, c_sel, t_sel)
                beside = (f"cells {cu['k']}/{cu['n']} (p {fmt_p(cu['p_value'])}); layer "
                          f"trajectories {tu['k']}/{tu['n']}")
                if claim.secondary:
                    sc = stats.count_test(_values(r_sel, claim.secondary), claim.sign)
                    beside += f"; {claim.secondary_criterion}: {sc['k']}/{sc['n']} runs"
                universal_ok = (tu["k"] == tu["n"]) if claim.universal else None
                estimate = f"{claim.mean_label} {with_ci(ru['mean'], ru['ci_low'], ru['ci_high'])}"
                primary = level == PRIMARY[0] and (origin == PRIMARY[1] or not claim.per_origin)
                rows.append(claim_row(
                    claim.id, claim.text, level, ru, role="primary" if primary else "secondary",
                    unit=UNIT, measured=f"{ru['k']}/{ru['n']} {UNIT}", estimate=estimate,
                    test=stats.TEST_FLIP, beside=beside, universal_ok=universal_ok,
                    criterion=claim.criterion, origin=origin if claim.per_origin else "last",
                    **{"from": _origin_label(r_sel, origin) if claim.per_origin
                       else "last checkpoint"}))
    claims = pd.DataFrame(rows)
    order = claims["role"].ne("primary").astype(int)  # each claim's primary row first
    claims = claims.assign(_o=order).sort_values(["claim_id", "_o"], kind="stable")
    return decide(claims.drop(columns="_o"), holm_primary=True)[CLAIM_COLUMNS] \
        .reset_index(drop=True)


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
