"""The E1 and E2 claims, each measured on a collated sweep (or one run) and given a verdict.

Every claim is a predicted sign of one per-trajectory statistic (:mod:`qkgeom.analysis.stats`).
It is evaluated at the weight and the token level and from step 0 and from the
post-transient reference step, side by side (docs/definitions.md); each row says which. The
verdict comes from the count and the sign-test p-value by
:func:`qkgeom.analysis.stats.verdict` (rules in docs/report.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.kit import CLAIM_COLUMNS, TEST_SIGN, signed


@dataclass(frozen=True)
class Claim:
    """One claim: the statistic whose sign is counted, and how to describe it."""

    id: str
    text: str
    statistic: str
    sign: int  # predicted sign of ``statistic``
    criterion: str  # what one trajectory must show, in words
    secondary: str | None = None  # a second statistic whose count is shown alongside
    secondary_criterion: str = ""
    mean_label: str = ""  # the across-trajectory mean shown with its bootstrap CI
    mean_statistic: str | None = None
    universal: bool = False  # "in all trajectories": supported only if k = n
    per_origin: bool = True  # False: measured at the last checkpoint only


CLAIMS = (
    Claim("E1.1", "PR_Q expands", "delta_pr_q", +1, "ΔPR_Q > 0 (last probe − origin)",
          "slope_pr_q", "OLS slope > 0", "mean ΔPR_Q"),
    Claim("E1.2", "PR_K shrinks", "delta_pr_k", -1, "ΔPR_K < 0 (last probe − origin)",
          "slope_pr_k", "OLS slope < 0", "mean ΔPR_K"),
    Claim("E1.3", "PR_Q − PR_K > 0 in all trajectories", "contrast_min_after", +1,
          "PR_Q − PR_K > 0 at every probe after the origin", "contrast_time_mean",
          "time-averaged contrast > 0", "mean time-averaged PR_Q − PR_K",
          "contrast_time_mean", universal=True),
    Claim("E2.1", "Key shrinkage goes with a narrower QKᵀ spectrum", "rho_k_qk", +1,
          "Spearman ρ over steps of PR_K with pr_qk > 0", mean_label="mean ρ"),
    Claim("E2.2", "A narrower QKᵀ spectrum goes with more peaked attention", "rho_qk_entropy",
          +1, "Spearman ρ over steps of pr_qk with attention entropy > 0",
          mean_label="mean ρ"),
    Claim("E2.3", "Across heads, a narrower QKᵀ spectrum goes with more peaked attention",
          "rho_heads_qk_entropy", +1,
          "Spearman ρ across the layer's heads of pr_qk with attention entropy > 0 "
          "(last checkpoint, per run, seed-averaged)", mean_label="mean ρ", per_origin=False),
)

def _origin_label(traj: pd.DataFrame, origin: str) -> str:
    if "start_step" not in traj:
        return "step 0" if origin == "step0" else "reference"
    starts = sorted(int(s) for s in traj["start_step"].dropna().unique())
    if not starts:
        return origin
    span = f"step {starts[0]}" if len(starts) == 1 else f"steps {starts[0]}–{starts[-1]}"
    return span if origin == "step0" else f"reference, {span}"


def evaluate_claims(traj: pd.DataFrame, boot: pd.DataFrame | None = None) -> pd.DataFrame:
    """The claims table from per-trajectory statistics (:func:`qkgeom.analysis.stats.trajectory_stats`,
    seed-averaged) and optionally their bootstrap CIs (:func:`qkgeom.analysis.stats.bootstrap_ci`).

    One row per claim × level × origin (claims measured only at the last checkpoint get one
    row per level, origin ``last``). ``k`` of ``n`` trajectories show the predicted sign;
    ``p_value`` is the exact one-sided sign test; ``verdict`` is :func:`qkgeom.analysis.stats.verdict`.
    """
    rows = []
    for claim in CLAIMS:
        for level in stats.LEVELS:
            origins = stats.ORIGINS if claim.per_origin else ("step0",)
            for origin in origins:
                sel = traj[(traj["level"] == level) & (traj["origin"] == origin)] \
                    if not traj.empty else traj
                values = sel[claim.statistic] if claim.statistic in sel else pd.Series([], dtype=float)
                ct = stats.count_test(values, claim.sign)
                text = f"{ct['k']}/{ct['n']} trajectories"
                if claim.secondary and claim.secondary in sel:
                    sc = stats.count_test(sel[claim.secondary], claim.sign)
                    text += f" ({claim.secondary_criterion}: {sc['k']}/{sc['n']})"
                mean_stat = claim.mean_statistic or claim.statistic
                mean = lo = hi = np.nan
                if boot is not None and not boot.empty:
                    b = boot[(boot["level"] == level) & (boot["origin"] == origin)
                             & (boot["statistic"] == mean_stat)]
                    if len(b):
                        mean, lo, hi = (float(b.iloc[0][c]) for c in ("mean", "ci_low", "ci_high"))
                elif mean_stat in sel and sel[mean_stat].notna().any():
                    mean = float(sel[mean_stat].mean())
                estimate = f"{claim.mean_label} {signed(mean)}"
                if np.isfinite(lo):
                    estimate += f" [{signed(lo)}, {signed(hi)}]"
                rows.append({
                    "claim_id": claim.id, "claim": claim.text, "level": level,
                    "origin": origin if claim.per_origin else "last",
                    "from": _origin_label(sel, origin) if claim.per_origin else "last checkpoint",
                    "criterion": claim.criterion, "k": ct["k"], "n": ct["n"],
                    "share": ct["share"], "measured": text, "mean": mean, "ci_low": lo,
                    "ci_high": hi, "estimate": estimate, "test": TEST_SIGN,
                    "p_value": ct["p_value"],
                    "verdict": stats.verdict(ct["k"], ct["n"], ct["p_value"], claim.universal),
                })
    return pd.DataFrame(rows, columns=CLAIM_COLUMNS)
