"""The E4 claims with computed verdicts: over seeds (:func:`seed_claims`, the seed the
unit) or for one model (:func:`e4_claims`, the model the unit for E4.1/E4.2, its layers
counted descriptively for E4.3/E4.4).

Every claim starts from the per-layer regime call and its scores; each claim's primary row
(:data:`PRIMARY_LEVEL`) is decided at α, the others are secondary (Holm). No smallest
effect of interest is declared, so no row is *equivalent to no effect*. The scores and why:
docs/protocols.md#scores-one-value-per-seed and #e4-claims.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats as sst

from qkgeom.analysis import stats
from qkgeom.analysis.e4.regime import CALLS, FALL, MIN_POINTS, MONOTONE, RISE_FALL
from qkgeom.analysis.e4.trends import PRIMARY, TREND_METRICS
from qkgeom.analysis.kit import claim_row, decide

__all__ = ["COLUMNS", "ONE_SIDED_ONLY", "PRIMARY_LEVEL", "e4_claims", "model_scores",
           "seed_claims", "seed_scores"]

#: E4's claims.csv: the shared columns (:func:`qkgeom.analysis.kit.claim_row`) less those
#: E4 leaves empty (origin, interval, equivalence: no row is read that way).
COLUMNS = ["claim_id", "claim", "role", "level", "unit", "measured", "k", "n", "estimate",
           "test", "p_value", "p_opposite", "p_sign", "p_adj", "p_opposite_adj", "family",
           "beside", "verdict", "reason"]
_LAYER_FLIP = "sign-flip test over layers (not independent: descriptive)"
_MODEL_P = "the model's smallest layer p, Šidák-adjusted over its layers"
_HEAD_LEVELS = ("token", "weight")
TEXTS = {"E4.1": "The monotone PR_Q − PR_K trend is not universal",
         "E4.2": "An early-training regime exists",
         "E4.3": "… and decays over the full run",
         "E4.4": "The interaction-rank ↔ attention-entropy link stays visible (across heads, "
                 "per layer)"}
#: The primary row of each claim (docs/protocols.md): E4.1–E4.3 on the primary contrast,
#: E4.4 at the token level; every other row is secondary.
PRIMARY_LEVEL = {"E4.1": TREND_METRICS[PRIMARY], "E4.2": TREND_METRICS[PRIMARY],
                 "E4.3": TREND_METRICS[PRIMARY], "E4.4": "token"}


#: Claims whose score is the minimum of two tests' (rise and fall): negative at a constant
#: curve, so the opposite direction is never read (no *not supported*; protocol 2).
ONE_SIDED_ONLY = ("E4.2", "E4.3")
_NO_OPPOSITE = ("not supported is not read: the score joins two tests (rise and fall) and "
                "is negative under the null")


def _row(cid: str, level: str, unit: str, measured: str, u: dict, estimate: str, test: str,
         beside: str, reason: str = "") -> dict:
    """One claims row (:func:`qkgeom.analysis.kit.claim_row`) with the claim's text and its
    role (:data:`PRIMARY_LEVEL`); the verdict comes later (:func:`_frame`). For
    :data:`ONE_SIDED_ONLY` claims the opposite direction's p is left out (NaN)."""
    role = "primary" if PRIMARY_LEVEL[cid] == level else "secondary"
    if cid in ONE_SIDED_ONLY:
        u = {**u, "p_opposite": float("nan")}
        beside = f"{beside}; {_NO_OPPOSITE}" if beside else _NO_OPPOSITE
    return claim_row(cid, TEXTS[cid], level, u, role=role, unit=unit, measured=measured,
                     estimate=estimate, test=test, beside=beside, reason=reason)


def _sidak(p: np.ndarray) -> np.ndarray:
    """Along the last axis, the smallest of the finite p's, Šidák-adjusted over their
    number: 1 − (1 − min)^L (NaN where none is finite)."""
    p = np.asarray(p, dtype=float)
    ok = np.isfinite(p)
    n = ok.sum(axis=-1)
    low = np.where(ok, p, np.inf).min(axis=-1, initial=np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n > 0, -np.expm1(n * np.log1p(-np.minimum(low, 1.0))), np.nan)


def _probit(p: np.ndarray) -> np.ndarray:
    return sst.norm.isf(p)


def seed_scores(z_rise: np.ndarray, z_fall: np.ndarray) -> dict[str, np.ndarray]:
    """The scores of E4.1–E4.3 from the layers' scores along the last axis (the layers of
    one model; any leading axes, e.g. seeds): ``s1`` = Φ⁻¹(1 − Šidák p of a fall), ``s2`` =
    the same of a rise then fall (p of min(z_rise, z_fall)), ``s3`` = the mean of
    min(z_rise, z_fall); the p's are the mid-p's Φ(−z), continuous, so each score is about
    N(0, 1) at a constant curve (s2 and s3 below it: the minimum of two scores). Layers
    with a NaN score drop out."""
    z_fall = np.asarray(z_fall, dtype=float)
    z_reg = np.minimum(np.asarray(z_rise, dtype=float), z_fall)
    return {"s1": _probit(_sidak(sst.norm.sf(z_fall))),
            "s2": _probit(_sidak(sst.norm.sf(z_reg))), "s3": stats.nanmean(z_reg, axis=-1)}


def _z_regime(t: pd.DataFrame) -> np.ndarray:
    """Each layer's rise-and-fall score min(z_rise, z_fall)."""
    return np.minimum(t["z_rise"].to_numpy(float), t["z_fall"].to_numpy(float))


def _layers(trends: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The layers of ``metric`` with a call (enough checkpoints after the warm-up)."""
    if trends.empty:
        return trends
    return trends[(trends["metric"] == metric) & (trends["n"] >= MIN_POINTS)
                  & trends["p_fall"].notna()]


def model_scores(trends: pd.DataFrame, heads: pd.DataFrame, metric: str = PRIMARY
                 ) -> dict[str, float]:
    """One model's values for each claim on ``metric``: ``p_fall``/``p_regime`` (E4.1/E4.2,
    Šidák over layers) and their probit scores ``s1``/``s2``, ``s3`` (E4.3: the mean
    rise-and-fall score), ``s4`` (E4.4, token level) and ``s4_weight``; and the counts
    ``layers``, ``falls``, ``regimes``, ``rises`` and the mean ``share_lost`` of the
    layers that rise then fall."""
    out = _layer_scores(_layers(trends, metric))
    for level, key in (("token", "s4"), ("weight", "s4_weight")):
        last = _last_rho(heads, level)
        out[key] = float(last.mean()) if len(last) else np.nan
    return out


def _layer_scores(t: pd.DataFrame) -> dict[str, float]:
    """:func:`model_scores` but E4.4, from the layers :func:`_layers` keeps. The model's p
    of a fall (E4.1) and of a rise then fall (E4.2) is Šidák over its layers of the calls'
    p's; its scores ``s1``, ``s2`` the same from the mid-p's (Φ(−z): continuous, about
    N(0, 1) without the effect)."""
    lost = t.loc[t["call"] == RISE_FALL, "share_lost"].dropna()
    pf, pr = t["p_fall"].to_numpy(float), t["p_rise"].to_numpy(float)
    s = seed_scores(t["z_rise"].to_numpy(float), t["z_fall"].to_numpy(float))
    return {"layers": len(t), "falls": int(t["call"].isin([RISE_FALL, FALL]).sum()),
            "regimes": int((t["call"] == RISE_FALL).sum()),
            "rises": int(t["call"].isin([RISE_FALL, MONOTONE]).sum()),
            "p_fall": float(_sidak(pf)), "p_regime": float(_sidak(np.maximum(pf, pr))),
            **{k: float(v) for k, v in s.items()},
            "share_lost": float(lost.mean()) if len(lost) else np.nan}


def _last_rho(heads: pd.DataFrame, level: str) -> pd.Series:
    """Per layer ρ(pr_qk, entropy) across its heads at the last checkpoint."""
    if heads.empty:
        return pd.Series(dtype=float)
    h = heads[(heads["level"] == level) & (heads["layer"] >= 0)]
    return h.loc[h["step"] == h["step"].max(), "rho"].dropna()


def _calls_text(t: pd.DataFrame) -> str:
    counts = t["call"].value_counts()
    return ", ".join(f"{int(counts[c])} {c}" for c in CALLS if c in counts) or "no layer"


def _boot_text(boot: pd.DataFrame | None, calls: tuple[str, ...], what: str) -> str:
    """How often the block bootstrap gives these calls: the mean over layers of each
    layer's share of resamples (``calls = ()``: the share of resamples in which some
    layer falls)."""
    if boot is None or boot.empty:
        return ""
    share = (boot["share_any_fall"].iloc[0] if not calls else
             sum(boot[f"share_{c.replace(' ', '_')}"] for c in calls).mean())
    per = "" if not calls else "mean over layers, "
    return (f"; block bootstrap: {what} in {share:.0%} of resamples ({per}"
            f"{int(boot['n_boot'].iloc[0])} resamples of {int(boot['n_blocks'].iloc[0])} "
            "blocks)")


_RULE = ("rise / fall = gain to the peak / drop from it to the last checkpoint after the LR "
         "warm-up, beyond what noise gives a monotone curve (p < 0.05)")


def _model_rows(t: pd.DataFrame, level: str, boot: pd.DataFrame | None,
                missing: str = "") -> list[dict]:
    """E4.1–E4.3 of one model on one contrast."""
    n = len(t)
    reason = missing or ("" if n else f"no layer with ≥ {MIN_POINTS} checkpoints after the "
                                      "warm-up")
    calls = f"calls: {_calls_text(t)}" if n else "n/a"
    rows = []
    s = _layer_scores(t)
    for cid, p, score, k, what, boot_calls, boot_what in (
            ("E4.1", s["p_fall"], s["s1"], s["falls"], "fall", (), "some layer falls"),
            ("E4.2", s["p_regime"], s["s2"], s["regimes"], "rise then fall", (RISE_FALL,),
             "rise then fall")):
        # the unit is the model: one unit, leaning to the claim when its score is > 0
        u = {"k": int(score > 0) if n else 0, "n": 1 if n else 0, "p_value": p}
        rows.append(_row(cid, level, "model", f"{k}/{n} layers {what}", u, calls, _MODEL_P,
                         _RULE + _boot_text(boot, boot_calls, boot_what), reason))
    u = stats.unit_test(_z_regime(t), +1)
    est = f"mean score {u['mean']:+.2f}" if np.isfinite(u["mean"]) else "n/a"
    if not np.isnan(s["share_lost"]):
        est += f"; share of the gain lost (rise then fall) {s['share_lost']:.2f}"
    rows.append(_row("E4.3", level, "layer", f"{u['k']}/{u['n']} layers with a rise-and-fall "
                     "score > 0", u, est, _LAYER_FLIP,
                     "score = min(z_rise, z_fall), about N(0, 1) without the effect"
                     + _boot_text(boot, (RISE_FALL,), "rise then fall"), reason))
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
    return _row("E4.4", level, "layer",
                f"{u['k']}/{u['n']} layers with ρ(pr_qk, entropy) > 0 at the last checkpoint",
                u, _mean_ci(u, "mean per-layer ρ"), _LAYER_FLIP, beside, reason)


def _mean_ci(u: dict, what: str) -> str:
    if not np.isfinite(u["mean"]):
        return "n/a"
    text = f"{what} {u['mean']:+.3f}"
    if np.isfinite(u["ci_low"]):
        text += f" [{u['ci_low']:+.3f}, {u['ci_high']:+.3f}]"
    return text


def e4_claims(trends: pd.DataFrame, heads: pd.DataFrame,
              boot: pd.DataFrame | None = None) -> pd.DataFrame:
    """The E4 rows of **one model** from :func:`~qkgeom.analysis.e4.trends.trend_table`,
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
        t = _layers(trends, metric)
        rows += _model_rows(t, level, boot if metric == PRIMARY else None,
                            "" if metric in present else f"no {metric} recorded")
    rows += [_head_rows(heads, level) for level in _HEAD_LEVELS]
    return _frame(rows)


def _frame(rows: list[dict]) -> pd.DataFrame:
    """The rows with their verdicts (:func:`qkgeom.analysis.kit.decide`: each primary row at
    α, the secondary rows Holm-adjusted together), each claim's primary row first."""
    out = pd.DataFrame(rows)
    for col in ("p_value", "p_opposite", "p_sign"):
        out[col] = out[col].astype(float)
    out = decide(out, holm_primary=False)
    order = out["claim_id"].map({c: i for i, c in enumerate(TEXTS)}) * 2 \
        + out["role"].ne("primary").astype(int)
    return out.assign(_o=order).sort_values("_o", kind="stable")[COLUMNS] \
        .reset_index(drop=True)


_SEED_TESTS = {  # claim -> (score key, what the score is, per-seed count key, count text)
    "E4.1": ("s1", "Φ⁻¹(1 − p) of the seed's Šidák-adjusted smallest layer p of a fall",
             "falls", "layers fall"),
    "E4.2": ("s2", "Φ⁻¹(1 − p) of the seed's Šidák-adjusted smallest layer p of a rise "
             "then fall", "regimes", "layers rise then fall"),
    "E4.3": ("s3", "the mean over the seed's layers of min(z_rise, z_fall)", "regimes",
             "layers rise then fall"),
}


def seed_claims(units: dict[str, tuple[pd.DataFrame, pd.DataFrame]]) -> pd.DataFrame:
    """The E4 rows over **seeds**: ``units`` maps each seed (its label) to its
    ``(trends, heads)``; one value per seed and claim (:func:`model_scores`), the sign-flip
    test over seeds and the verdict. Contrasts as in :func:`e4_claims`."""
    names = list(units)
    rows = []
    present = set().union(*(set(t["metric"]) for t, _ in units.values() if not t.empty))
    for metric, level in TREND_METRICS.items():
        if metric not in present and metric != PRIMARY:
            continue
        scores = {s: model_scores(*units[s], metric) for s in names}
        for cid, (key, what, count, count_text) in _SEED_TESTS.items():
            vals = [scores[s][key] for s in names]
            u = stats.unit_test(vals, +1)
            reason = "" if metric in present else f"no {metric} recorded"
            reason = reason or ("" if u["n"] else "no seed with a layer called")
            per = ", ".join(f"{scores[s][count]}/{scores[s]['layers']}" for s in names)
            beside = f"score = {what}; per seed, {count_text}: {per}"
            if cid != "E4.3":
                p_key = "p_fall" if cid == "E4.1" else "p_regime"
                alone = sum(scores[s][p_key] < stats.ALPHA for s in names)
                beside += f"; seeds significant on their own: {alone}/{len(names)}"
            else:
                lost = stats.finite(scores[s]["share_lost"] for s in names)
                if len(lost):
                    beside += (f"; share of the gain lost (layers that rise then fall), mean "
                               f"over seeds {np.mean(lost):.2f}")
            rows.append(_row(cid, level, "seed", f"{u['k']}/{u['n']} seeds with score > 0",
                             u, _mean_ci(u, "mean score"), stats.TEST_FLIP, beside, reason))
    for level, key in (("token", "s4"), ("weight", "s4_weight")):
        vals = [model_scores(*units[s])[key] for s in names]
        u = stats.unit_test(vals, +1)
        reason = "" if u["n"] else (f"no seed with a per-layer ρ (per-head pr_qk_{level} and "
                                    "attention entropy, ≥ 3 heads per layer)")
        rows.append(_row("E4.4", level, "seed",
                         f"{u['k']}/{u['n']} seeds with mean per-layer ρ > 0", u,
                         _mean_ci(u, "mean ρ"), stats.TEST_FLIP,
                         "per seed: the mean over layers of ρ(pr_qk, entropy) across heads "
                         "at the last checkpoint", reason))
    return _frame(rows)
