"""The E4 claims (docs/protocols.md) on one analysed checkpoint family, with computed verdicts.

Unit: a layer of the model (layer level, head −1). Layers of one model are **not
independent**: the tests below count them and give p-values that describe, not infer; the
report says so. Each claim is made for every contrast present, the primary
``contrast_token_heads`` first (:data:`qkgeom.analysis.e4.trends.TREND_METRICS`):

- **E4.1** the monotone contrast trend is not universal — *supported* when at least one
  layer is not a "monotone rise", *not supported* when every layer is;
- **E4.2** an early-training regime exists — layers called "rise then fall" or "rise then
  flat" (verdict rule over layers, exact sign test);
- **E4.3** it decays — among the layers with a rise (any call but "none"), those called
  "rise then fall"; the share of the gain lost is shown;
- **E4.4** the interaction-rank ↔ attention-entropy link stays visible — per layer, the
  Spearman ρ across its heads of pr_qk with attention entropy at the last checkpoint > 0
  (sign-flip and sign tests over layers); beside it the per-checkpoint count and the ρ
  pooled over all heads (which mixes depths, so only shown).

With a token-block bootstrap (:mod:`qkgeom.analysis.e4.bootstrap`) the primary rows also
show how often the resampled trajectories give the same answer.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.e4.trends import (
    CALLS,
    MONOTONE,
    PRIMARY,
    RISE_FALL,
    RISE_FLAT,
    TREND_METRICS,
)

__all__ = ["COLUMNS", "e4_claims"]

COLUMNS = ["claim_id", "claim", "level", "unit", "measured", "k", "n", "estimate", "test",
           "p_value", "p_sign", "beside", "verdict", "reason"]
_LAYER_SIGN = "exact sign test over layers (not independent: descriptive)"
_LAYER_FLIP = "sign-flip test over layers (not independent: descriptive)"
_HEAD_LEVELS = ("token", "weight")


def _row(cid: str, text: str, level: str, unit: str, measured: str, k: int, n: int,
         estimate: str, test: str, p: float, p_sign: float, beside: str, verdict: str,
         reason: str = "") -> dict:
    return dict(zip(COLUMNS, (cid, text, level, unit, measured, k, n, estimate, test, p,
                              p_sign, beside, verdict, reason), strict=True))


def _calls_text(t: pd.DataFrame) -> str:
    counts = t["call"].value_counts()
    return ", ".join(f"{int(counts[c])} {c}" for c in CALLS if c in counts) or "no layer"


def _boot_text(boot: pd.DataFrame | None, calls: tuple[str, ...], what: str) -> str:
    """How often the block bootstrap gives these calls: the mean over layers of each
    layer's share of resamples (or, for ``calls = ()``, the share of resamples in which
    some layer is not a monotone rise)."""
    if boot is None or boot.empty:
        return ""
    share = (boot["share_any_not_monotone"].iloc[0] if not calls else
             sum(boot[f"share_{c.replace(' ', '_')}"] for c in calls).mean())
    per = "" if not calls else "mean over layers, "
    return (f"; block bootstrap: {what} in {share:.0%} of resamples ({per}"
            f"{int(boot['n_boot'].iloc[0])} resamples of {int(boot['n_blocks'].iloc[0])} "
            "blocks)")


def _trend_rows(t: pd.DataFrame, level: str, boot: pd.DataFrame | None) -> list[dict]:
    n = len(t)
    reason = "" if n else "no layer with ≥ 3 checkpoints of this contrast"
    k1 = int((t["call"] != MONOTONE).sum()) if n else 0
    v1 = stats.NOT_EVALUATED if not n else (stats.SUPPORTED if k1 >= 1 else stats.NOT_SUPPORTED)
    rows = [_row("E4.1", "The monotone PR_Q − PR_K trend is not universal", level, "layer",
                 f"{k1}/{n} layers not a monotone rise", k1, n,
                 f"calls: {_calls_text(t) if n else 'n/a'}",
                 "supported when at least one layer is not a monotone rise", np.nan, np.nan,
                 "monotone rise = peak at the last checkpoint and a significant whole-run "
                 "Mann–Kendall increase" + _boot_text(boot, (), "some layer not a monotone rise"),
                 v1, reason)]
    regime = t["call"].isin([RISE_FALL, RISE_FLAT]) if n else pd.Series(dtype=bool)
    ct = stats.count_test(np.where(regime, 1.0, -1.0), +1) if n else stats.count_test([], 1)
    peaks = sorted(int(s) for s in t.loc[regime, "peak_step"]) if n else []
    rows.append(_row(
        "E4.2", "An early-training regime exists", level, "layer",
        f"{ct['k']}/{ct['n']} layers rise then fall or rise then flat", ct["k"], ct["n"],
        "peaks at step " + (", ".join(map(str, peaks)) if peaks else "n/a"), _LAYER_SIGN,
        ct["p_value"], ct["p_value"],
        "rise = significant Mann–Kendall increase from the first checkpoint to the peak"
        + _boot_text(boot, (RISE_FALL, RISE_FLAT), "a regime"),
        stats.verdict(ct["k"], ct["n"], ct["p_value"], reason=reason), reason))
    rose = t[t["call"] != "none"] if n else t
    ct = stats.count_test(np.where(rose["call"] == RISE_FALL, 1.0, -1.0) if len(rose) else [], +1)
    lost = rose["share_lost"].dropna() if len(rose) else pd.Series(dtype=float)
    why = reason or ("" if len(rose) else "no layer with a rise")
    rows.append(_row(
        "E4.3", "… and decays over the full run", level, "layer with a rise",
        f"{ct['k']}/{ct['n']} layers with a rise then fall", ct["k"], ct["n"],
        f"mean share of the gain lost {lost.mean():.2f}" if len(lost) else "n/a", _LAYER_SIGN,
        ct["p_value"], ct["p_value"],
        "fall = significant Mann–Kendall decrease from the peak to the last checkpoint"
        + _boot_text(boot, (RISE_FALL,), "rise then fall"),
        stats.verdict(ct["k"], ct["n"], ct["p_value"], reason=why), why))
    return rows


def _head_rows(heads: pd.DataFrame, level: str) -> dict:
    h = heads[heads["level"] == level] if not heads.empty else heads
    per_layer = h[h["layer"] >= 0] if len(h) else h
    reason = "" if len(per_layer) else f"no per-head pr_qk_{level} and attention entropy"
    if len(per_layer):
        last = per_layer[per_layer["step"] == per_layer["step"].max()]
        u = stats.unit_test(last["rho"], +1)
        counts = per_layer.groupby("step")["rho"].agg(
            lambda r: stats.count_test(r, +1)["share"] >= stats.SUPPORT_SHARE)
        pooled = h[(h["layer"] == -1) & (h["step"] == h["step"].max())]["rho"]
        few = int((last["n_heads"] < 3).sum())
        rho = f"{pooled.iloc[0]:+.2f}" if len(pooled) and np.isfinite(pooled.iloc[0]) else "n/a"
        beside = (f"checkpoints where ≥ {stats.SUPPORT_SHARE:.0%} of layers have ρ > 0: "
                  f"{int(counts.sum())}/{len(counts)}; pooled over all heads at the last "
                  f"checkpoint (mixes depths, shown only): ρ {rho}")
        if few:
            beside += f"; {few} layer(s) with < 3 heads: ρ = ±1 by construction"
    else:
        u, beside = stats.unit_test([], +1), ""
    estimate = f"mean per-layer ρ {u['mean']:+.3f}" if np.isfinite(u["mean"]) else "n/a"
    if np.isfinite(u["ci_low"]):
        estimate += f" [{u['ci_low']:+.3f}, {u['ci_high']:+.3f}]"
    return _row("E4.4", "The interaction-rank ↔ attention-entropy link stays visible (across "
                "heads, per layer)", level, "layer",
                f"{u['k']}/{u['n']} layers with ρ(pr_qk, entropy) > 0 at the last checkpoint",
                u["k"], u["n"], estimate, _LAYER_FLIP, u["p_value"], u["p_sign"], beside,
                stats.verdict(u["k"], u["n"], u["p_value"], reason=reason), reason)


def e4_claims(trends: pd.DataFrame, heads: pd.DataFrame,
              boot: pd.DataFrame | None = None) -> pd.DataFrame:
    """The E4 rows from :func:`~qkgeom.analysis.e4.trends.trend_table`,
    :func:`~qkgeom.analysis.e4.trends.head_correlations` (duplicates already left out) and
    optionally the block bootstrap of the primary contrast
    (:func:`~qkgeom.analysis.e4.bootstrap.block_bootstrap`). The primary contrast's rows
    come first; a contrast the folder does not record is listed only if it is the primary
    (*not evaluated*)."""
    rows = []
    present = set(trends["metric"]) if not trends.empty else set()
    for metric, level in TREND_METRICS.items():
        if metric not in present and metric != PRIMARY:
            continue
        t = trends[(trends["metric"] == metric) & (trends["n"] >= 3)] \
            if metric in present else trends.iloc[0:0]
        for r in _trend_rows(t, level, boot if metric == PRIMARY else None):
            if metric not in present:
                r.update(verdict=stats.NOT_EVALUATED, reason=f"no {metric} recorded")
            rows.append(r)
    rows += [_head_rows(heads, level) for level in _HEAD_LEVELS]
    out = pd.DataFrame(rows, columns=COLUMNS)
    out["p_value"] = out["p_value"].astype(float)
    return out
