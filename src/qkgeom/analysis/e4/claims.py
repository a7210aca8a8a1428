"""The E4 claims (docs/definitions.md) on one analysed checkpoint family, with computed verdicts.

Unit: a layer of the model (layer level, head −1), at the token level and, beside it, the
weight level. Counts, the exact one-sided sign test and the verdict rule are the E1/E2 ones
(:func:`qkgeom.analysis.stats.count_test`, :func:`qkgeom.analysis.stats.verdict`), except E4.1, whose claim is
that something is *not* universal:

- **E4.1** the monotone contrast trend is not universal — k of n layers show a significant
  whole-run Mann–Kendall increase; *supported* when k < n (at least one layer lacks it),
  *not supported* when k = n;
- **E4.2** it survives as an early-training regime — layers with an early regime
  (a significant increasing prefix of ≥ 4 checkpoints);
- **E4.3** that decays over the run — among layers whose regime ends before the last
  checkpoint, the contrast at the last checkpoint is below its value at the regime's end
  (the count of significant Mann–Kendall decreases after the regime is shown beside);
- **E4.4** the interaction-rank ↔ attention-entropy link stays visible — per checkpoint,
  Spearman ρ across all heads of pr_qk with attention entropy > 0 (the count with
  p < 0.05 beside; last checkpoint per layer in the estimate).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats

__all__ = ["COLUMNS", "e4_claims"]

COLUMNS = ["claim_id", "claim", "level", "unit", "measured", "k", "n", "estimate", "test",
           "p_value", "verdict"]
_SIGN_TEST = "exact one-sided sign test"


def _row(cid: str, text: str, level: str, unit: str, measured: str, k: int, n: int,
         estimate: str, test: str, p: float, verdict: str) -> dict:
    return dict(zip(COLUMNS, (cid, text, level, unit, measured, k, n, estimate, test, p,
                              verdict), strict=True))


def _mean(x: pd.Series) -> str:
    x = x.dropna()
    return f"{x.mean():+.3f}" if len(x) else "n/a"


def e4_claims(trends: pd.DataFrame, heads: pd.DataFrame) -> pd.DataFrame:
    """The E4 rows from :func:`~qkgeom.analysis.e4.trends.trend_table` and
    :func:`~qkgeom.analysis.e4.trends.head_correlations` (duplicates already left out)."""
    rows = []
    for level in ("token", "weight"):
        t = trends[trends["level"] == level] if not trends.empty else trends
        t = t[t["n"] >= 3] if not t.empty else t
        n = len(t)
        k = int(t["monotone_increase"].sum()) if n else 0
        verdict = "not evaluated" if n == 0 else ("supported" if k < n else "not supported")
        rows.append(_row(
            "E4.1", "The monotone PR_Q − PR_K trend is not universal", level, "layer",
            f"{k}/{n} layers with a significant whole-run increase (Mann–Kendall, "
            f"one-sided p < {stats.ALPHA})", k, n, f"mean ρ(contrast, step) "
            f"{_mean(t['rho']) if n else 'n/a'}", "Mann–Kendall per layer; supported if k < n",
            float("nan"), verdict))

        ind = np.where(t["has_regime"].to_numpy(bool), 1.0, -1.0) if n else []
        ct = stats.count_test(ind, +1)
        ends = t.loc[t["has_regime"], "regime_end_step"] if n else pd.Series(dtype=float)
        rows.append(_row(
            "E4.2", "The trend survives as an early-training regime", level, "layer",
            f"{ct['k']}/{ct['n']} layers with a significant increasing prefix of ≥ 4 "
            "checkpoints", ct["k"], ct["n"],
            "regime ends at step " + (", ".join(str(int(s)) for s in sorted(ends.unique()))
                                      if len(ends) else "n/a"),
            _SIGN_TEST, ct["p_value"], stats.verdict(ct["k"], ct["n"], ct["p_value"])))

        after = t[t["has_regime"] & (t["suffix_n"] >= 2)] if n else t
        ct = stats.count_test(after["suffix_change"] if len(after) else [], -1)
        sig = int(after["decays"].sum()) if len(after) else 0
        rows.append(_row(
            "E4.3", "… and decays over the full run", level, "layer with a regime",
            f"{ct['k']}/{ct['n']} layers end lower than at the regime's end (significant "
            f"Mann–Kendall decrease after it: {sig}/{ct['n']})", ct["k"], ct["n"],
            f"mean change after the regime "
            f"{_mean(after['suffix_change']) if len(after) else 'n/a'}",
            _SIGN_TEST, ct["p_value"], stats.verdict(ct["k"], ct["n"], ct["p_value"])))

    for level in ("token", "weight"):
        h = heads[heads["level"] == level] if not heads.empty else heads
        pooled = h[h["layer"] == -1] if not h.empty else h
        ct = stats.count_test(pooled["rho"] if len(pooled) else [], +1)
        sig = int(((pooled["rho"] > 0) & (pooled["p"] < stats.ALPHA)).sum()) if len(pooled) else 0
        est = "n/a"
        if len(h):
            last = h[(h["step"] == h["step"].max()) & (h["layer"] >= 0)]
            lk = stats.count_test(last["rho"], +1)
            est = (f"mean ρ {_mean(pooled['rho'])}; last checkpoint: ρ > 0 in "
                   f"{lk['k']}/{lk['n']} layers")
        rows.append(_row(
            "E4.4", "The interaction-rank ↔ attention-entropy link stays visible (across "
            "heads)", level, "checkpoint",
            f"{ct['k']}/{ct['n']} checkpoints with ρ(pr_qk, entropy) > 0 across heads "
            f"(p < {stats.ALPHA}: {sig})", ct["k"], ct["n"], est, _SIGN_TEST, ct["p_value"],
            stats.verdict(ct["k"], ct["n"], ct["p_value"])))
    return pd.DataFrame(rows, columns=COLUMNS)
