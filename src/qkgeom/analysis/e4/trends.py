"""Trajectory statistics over a family of checkpoints (numpy + scipy, no torch).

Unit: one layer of one model (head −1), a contrast PR_Q − PR_K against checkpoint step:
``contrast_token_heads`` (the mean over query heads of the per-head contrasts, fair under
grouped-query attention: the primary), ``contrast_token`` (the concatenations; biased
upward under GQA), ``contrast_weight`` and, for rotary models, ``contrast_token_post``.
Layers of one model are not independent.

- **Mann–Kendall** (:func:`mann_kendall`, vectorised in :func:`mann_kendall_batch`):
  ``S = Σ_{i<j} sign(x_j − x_i)``, ``Var S = [n(n−1)(2n+5) − Σ_ties t(t−1)(2t+5)] / 18``,
  ``Z = (S ∓ 1)/√Var`` (continuity correction, 0 when S = 0), one-sided p for an increase
  ``1 − Φ(Z)`` and a decrease ``Φ(Z)``; Kendall's ``τ = S / (n(n−1)/2)``.
- **Regime call** (:func:`regime_calls`; docs/protocols.md): p = the checkpoint of the
  largest contrast (the first, on ties). *rise then fall*: a significant increase on
  [first, p] and a significant decrease on [p, last], p before the last checkpoint (each
  test needs ≥ 4 points to be able to reach p < 0.05); *rise then flat*: the increase
  significant, the decrease not; *monotone rise*: p is the last checkpoint and the whole-run
  increase is significant (no decay); *none* otherwise. **Share of the gain lost** =
  (c_p − c_last)/(c_p − c_first) (NaN without a gain).
- **prefix trend** (descriptive): Mann–Kendall of the first k checkpoints, k = 3 … n.
- **across heads** (per checkpoint): Spearman ρ of ``pr_qk`` with ``attn_entropy`` over
  the heads of each layer (the E4.4 statistic) and, shown beside only, over all heads of
  all layers pooled (``layer = −1``; pooling mixes depths).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats as sst

from qkgeom.analysis.stats import ALPHA, spearman

__all__ = ["CALLS", "MIN_POINTS", "PRIMARY", "TREND_METRICS", "head_correlations",
           "layer_series", "mann_kendall", "mann_kendall_batch", "prefix_trends",
           "regime_calls", "trend_table"]

#: metric -> level label; the first is the primary layer contrast.
TREND_METRICS = {"contrast_token_heads": "token_heads", "contrast_token": "token",
                 "contrast_weight": "weight", "contrast_token_post": "token_post"}
PRIMARY = "contrast_token_heads"
MIN_POINTS = 4  # fewer points can never give a one-sided Mann–Kendall p < 0.05
RISE_FALL, RISE_FLAT, MONOTONE, NO_CALL = ("rise then fall", "rise then flat",
                                           "monotone rise", "none")
CALLS = (RISE_FALL, RISE_FLAT, MONOTONE, NO_CALL)
_CHUNK = 2_000_000  # elements of one (rows, m, m) comparison block


def _mk_p(s: np.ndarray, var: np.ndarray) -> dict[str, np.ndarray]:
    """Z (continuity corrected; 0 when S = 0) and the one-sided p's from S and Var S."""
    with np.errstate(invalid="ignore", divide="ignore"):
        z = np.where((var > 0) & (s != 0), (s - np.sign(s)) / np.sqrt(var), 0.0)
    z = np.where(np.isfinite(s), z, np.nan)
    return {"z": z, "p_increase": sst.norm.sf(z), "p_decrease": sst.norm.cdf(z)}


def _no_tie_var(m: np.ndarray | int) -> np.ndarray:
    m = np.asarray(m, dtype=float)
    return m * (m - 1) * (2 * m + 5) / 18.0


def mann_kendall_batch(x: np.ndarray) -> dict[str, np.ndarray]:
    """Mann–Kendall of every row of ``x`` (rows, m), ties corrected; arrays (rows,). NaN
    for m < 3 or a row with a non-finite value."""
    x = np.atleast_2d(np.asarray(x, dtype=float))
    rows, m = x.shape
    s = np.full(rows, np.nan)
    ties = np.zeros(rows)
    if m >= 3:
        step = max(1, _CHUNK // (m * m))
        upper = np.triu(np.ones((m, m), dtype=bool), k=1)
        for a in range(0, rows, step):
            blk = x[a:a + step]
            diff = np.sign(blk[:, None, :] - blk[:, :, None])  # [r, i, j] = sign(x_j − x_i)
            s[a:a + step] = (diff * upper).sum(axis=(1, 2))
            t = (diff == 0).sum(axis=2)  # per value: how many equal it (itself included)
            ties[a:a + step] = ((t - 1) * (2 * t + 5)).sum(axis=1)  # = Σ_groups t(t−1)(2t+5)
    s = np.where(np.isfinite(x).all(axis=1), s, np.nan)
    var = np.where(np.isfinite(s), _no_tie_var(m) - ties / 18.0, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        tau = s / (m * (m - 1) / 2) if m >= 2 else np.full(rows, np.nan)
    return {"s": s, "var_s": var, "tau": tau, **_mk_p(s, var)}


def mann_kendall(values: np.ndarray | list[float]) -> dict[str, float]:
    """Mann–Kendall trend test of one series in order (ties corrected; NaN for n < 3)."""
    x = np.asarray(values, dtype=float)
    mk = {k: float(v[0]) for k, v in mann_kendall_batch(x[None, :]).items()}
    mk["n"] = len(x)
    mk["p_two_sided"] = (float(min(1.0, 2 * sst.norm.sf(abs(mk["z"]))))
                         if np.isfinite(mk["z"]) else float("nan"))
    return mk


def _split_s(x: np.ndarray, peak: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mann–Kendall S of [first, peak], [peak, last] and the whole row, for rows without
    ties, from one sign matrix per row: column sums of its upper triangle accumulate into
    every prefix's S, row sums (from the end) into every suffix's."""
    rows, n = x.shape
    out = np.empty((3, rows))
    step = max(1, _CHUNK // (n * n))
    upper = np.triu(np.ones((n, n), dtype=np.int8), k=1)
    for a in range(0, rows, step):
        blk = x[a:a + step]
        d = np.sign(blk[:, None, :] - blk[:, :, None]).astype(np.int8) * upper
        prefix = np.cumsum(d.sum(axis=1, dtype=np.int64), axis=1)  # S of [0, p]
        suffix = np.cumsum(d.sum(axis=2, dtype=np.int64)[:, ::-1], axis=1)[:, ::-1]  # [p, n)
        r = np.arange(len(blk))
        p = peak[a:a + step]
        out[:, a:a + step] = prefix[r, p], suffix[r, p], prefix[:, -1]
    return out[0], out[1], out[2]


def regime_calls(x: np.ndarray, alpha: float = ALPHA) -> dict[str, np.ndarray]:
    """The regime call of every row of ``x`` (rows, n checkpoints in step order):
    ``peak`` (index), ``call``, ``p_rise`` (increase on [first, peak]), ``p_fall``
    (decrease on [peak, last]), ``p_whole`` (whole-run increase) and ``share_lost``; see the
    module docstring. NaN p where a test has fewer than :data:`MIN_POINTS` points."""
    x = np.atleast_2d(np.asarray(x, dtype=float))
    rows, n = x.shape
    peak = np.argmax(x, axis=1)
    p_rise, p_fall, p_whole = (np.full(rows, np.nan) for _ in range(3))
    ties = (np.diff(np.sort(x, axis=1), axis=1) == 0).any(axis=1) | ~np.isfinite(x).all(axis=1)
    fast = np.flatnonzero(~ties)
    if len(fast) and n >= MIN_POINTS:
        s_rise, s_fall, s_whole = _split_s(x[fast], peak[fast])
        p_rise[fast] = _mk_p(s_rise, _no_tie_var(peak[fast] + 1))["p_increase"]
        p_fall[fast] = _mk_p(s_fall, _no_tie_var(n - peak[fast]))["p_decrease"]
        p_whole[fast] = _mk_p(s_whole, _no_tie_var(n))["p_increase"]
    for p in np.unique(peak[ties]):  # exact tie corrections, one peak position at a time
        idx = np.flatnonzero(ties & (peak == p))
        p_rise[idx] = mann_kendall_batch(x[idx, :p + 1])["p_increase"]
        p_fall[idx] = mann_kendall_batch(x[idx, p:])["p_decrease"]
        p_whole[idx] = mann_kendall_batch(x[idx])["p_increase"]
    p_rise[peak + 1 < MIN_POINTS] = np.nan
    p_fall[n - peak < MIN_POINTS] = np.nan
    if n < MIN_POINTS:
        p_whole[:] = np.nan
    rise = p_rise < alpha
    fall = p_fall < alpha
    last = peak == n - 1
    call = np.where(last & (p_whole < alpha), MONOTONE,
                    np.where(rise & fall & ~last, RISE_FALL,
                             np.where(rise & ~last, RISE_FLAT, NO_CALL)))
    rows_i = np.arange(rows)
    top, first, end = x[rows_i, peak], x[:, 0], x[:, -1]
    gain = top - first
    with np.errstate(invalid="ignore", divide="ignore"):
        lost = np.where(gain > 0, (top - end) / np.where(gain > 0, gain, 1.0), np.nan)
    return {"peak": peak, "call": call, "p_rise": p_rise, "p_fall": p_fall,
            "p_whole": p_whole, "share_lost": lost}


def layer_series(metrics: pd.DataFrame, metric: str):
    """Yield (layer, steps, values) of the layer-level ``metric``, ordered by step."""
    sel = metrics[(metrics["head"] == -1) & (metrics["metric"] == metric)]
    for layer, grp in sel.groupby("layer", sort=True):
        grp = grp.groupby("step", as_index=False)["value"].mean().sort_values("step")
        yield int(layer), grp["step"].to_numpy(dtype=float), grp["value"].to_numpy(dtype=float)


def _spearman1(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    if len(x) < 3:
        return float("nan"), float("nan")
    rho, p = spearman(x, y)
    return float(rho), float(p)


def trend_table(metrics: pd.DataFrame, alpha: float = ALPHA) -> pd.DataFrame:
    """Per contrast metric and layer: the whole-run trend (Spearman ρ, Mann–Kendall), the
    peak, the regime call with its two tests and the share of the gain lost. Also
    ``has_regime`` (rise then fall or rise then flat), ``regime_end_step`` (its peak step),
    ``decays`` (rise then fall) and ``monotone_increase`` (whole-run increase significant)."""
    rows = []
    for metric, level in TREND_METRICS.items():
        for layer, steps, values in layer_series(metrics, metric):
            rho, p_rho = _spearman1(steps, values)
            mk = mann_kendall(values)
            rc = {k: v[0] for k, v in regime_calls(values[None, :], alpha).items()}
            peak_step = float(steps[int(rc["peak"])])
            call = str(rc["call"])
            regime = call in (RISE_FALL, RISE_FLAT)
            rows.append({"metric": metric, "level": level, "layer": layer, "n": len(values),
                         "first_step": steps[0], "last_step": steps[-1],
                         "first": values[0], "peak": values[int(rc["peak"])],
                         "last": values[-1], "peak_step": peak_step, "call": call,
                         "p_rise": rc["p_rise"], "p_fall": rc["p_fall"],
                         "share_lost": rc["share_lost"], "rho": rho, "p_rho": p_rho,
                         "mk_s": mk["s"], "mk_z": mk["z"], "mk_tau": mk["tau"],
                         "mk_p_increase": mk["p_increase"], "mk_p_decrease": mk["p_decrease"],
                         "monotone_increase": bool(mk["p_increase"] < alpha),
                         "has_regime": regime,
                         "regime_end_step": peak_step if regime else float("nan"),
                         "decays": call == RISE_FALL})
    return pd.DataFrame(rows)


def prefix_trends(metrics: pd.DataFrame) -> pd.DataFrame:
    """The prefix-trend curve (descriptive): per metric × layer and prefix length k = 3 …
    n, Spearman ρ and Mann–Kendall Z / p_increase of the first k checkpoints."""
    rows = []
    for metric, level in TREND_METRICS.items():
        for layer, steps, values in layer_series(metrics, metric):
            for k in range(3, len(values) + 1):
                rho, _ = _spearman1(steps[:k], values[:k])
                mk = mann_kendall(values[:k])
                rows.append({"metric": metric, "level": level, "layer": layer, "k": k,
                             "end_step": steps[k - 1], "rho": rho, "mk_z": mk["z"],
                             "mk_p_increase": mk["p_increase"]})
    return pd.DataFrame(rows, columns=["metric", "level", "layer", "k", "end_step", "rho",
                                       "mk_z", "mk_p_increase"])


def head_correlations(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per checkpoint and level: Spearman ρ across heads of pr_qk with attention entropy,
    per layer and pooled over all layers' heads (``layer = −1``, shown beside only)."""
    heads = metrics[metrics["head"] >= 0]
    rows = []
    for level in ("weight", "token"):
        wide = heads[heads["metric"].isin([f"pr_qk_{level}", "attn_entropy"])].pivot_table(
            index=["checkpoint", "step", "layer", "head"], columns="metric", values="value")
        if wide.empty or f"pr_qk_{level}" not in wide or "attn_entropy" not in wide:
            continue
        wide = wide.reset_index()
        for (ckpt, step), grp in wide.groupby(["checkpoint", "step"], sort=False):
            parts = [(int(layer), g) for layer, g in grp.groupby("layer")] + [(-1, grp)]
            for layer, g in parts:
                ok = g[[f"pr_qk_{level}", "attn_entropy"]].dropna()
                rho, p = _spearman1(ok[f"pr_qk_{level}"].to_numpy(),
                                    ok["attn_entropy"].to_numpy())
                rows.append({"checkpoint": ckpt, "step": step, "level": level, "layer": layer,
                             "n_heads": len(ok), "rho": rho, "p": p})
    out = pd.DataFrame(rows, columns=["checkpoint", "step", "level", "layer", "n_heads", "rho",
                                      "p"])
    return out.sort_values(["level", "step", "layer"], kind="stable", ignore_index=True)
