"""Trajectory statistics over a family of checkpoints (pandas + scipy, no torch).

Unit: one layer of one model (head −1), a metric against checkpoint step. For the paired
contrast ``PR_Q − PR_K`` (token level, and the weight level beside it):

- **whole-run trend**: Spearman ρ against step (two-sided p, as ``scipy.stats.spearmanr``)
  and the Mann–Kendall test: ``S = Σ_{i<j} sign(x_j − x_i)``, variance
  ``[n(n−1)(2n+5) − Σ_ties t(t−1)(2t+5)] / 18``, ``Z = (S ∓ 1)/√var`` (continuity
  correction, 0 when S = 0), one-sided p for an increase ``1 − Φ(Z)`` (and for a
  decrease ``Φ(Z)``), Kendall's ``τ = S / (n(n−1)/2)``. A *monotone increase* is
  p_increase < α (0.05).
- **growing prefixes**: the same on the first k checkpoints, k = 3 … n (the
  prefix-trend curve).
- **early regime**: the longest prefix (k ≥ 4: with fewer points no Mann–Kendall
  p-value can fall below 0.05) with a significant increase; it ends at that prefix's last
  checkpoint. ``regime_is_whole_run`` when that prefix is the whole run.
- **decay after it**: the trajectory from the regime's last checkpoint to the end (at
  least 2 points): ``suffix_change`` = last − value at the regime's end (``declines`` when
  < 0), its Spearman ρ (≥ 3 points) and Mann–Kendall p for a decrease; it ``decays`` when
  that decrease is significant (needs ≥ 4 points to be possible). By construction every
  longer prefix than the regime has no significant increase, so "the trend stops" is the
  definition; ``declines`` / ``decays`` say whether the contrast actually falls after it.
  ``peak_step``: the step of the largest contrast.
- **across heads** (per checkpoint): Spearman ρ of ``pr_qk`` with ``attn_entropy`` over the
  heads of each layer, and over all heads of all layers pooled (``layer = −1``), at the
  weight and the token level.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats as sst

from qkgeom.analysis.stats import ALPHA

__all__ = ["MIN_PREFIX", "TREND_METRICS", "head_correlations", "mann_kendall",
           "prefix_trends", "trend_table"]

TREND_METRICS = {"contrast_token": "token", "contrast_weight": "weight"}
MIN_PREFIX = 4


def mann_kendall(values: np.ndarray | list[float]) -> dict[str, float]:
    """Mann–Kendall trend test of a series in order (ties corrected; NaN for n < 3)."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    nan = float("nan")
    if n < 3 or not np.isfinite(x).all():
        return {"n": n, "s": nan, "var_s": nan, "z": nan, "tau": nan, "p_increase": nan,
                "p_decrease": nan, "p_two_sided": nan}
    diff = np.sign(x[None, :] - x[:, None])  # (n, n), [i, j] = sign(x_j − x_i)
    s = float(np.triu(diff, k=1).sum())
    _, counts = np.unique(x, return_counts=True)
    var = (n * (n - 1) * (2 * n + 5) - float((counts * (counts - 1) * (2 * counts + 5)).sum())) / 18
    z = (s - np.sign(s)) / np.sqrt(var) if var > 0 and s != 0 else 0.0
    return {"n": n, "s": s, "var_s": var, "z": float(z), "tau": s / (n * (n - 1) / 2),
            "p_increase": float(sst.norm.sf(z)), "p_decrease": float(sst.norm.cdf(z)),
            "p_two_sided": float(min(1.0, 2 * sst.norm.sf(abs(z))))}


def _spearman(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan"), float("nan")
    res = sst.spearmanr(x, y)
    return float(res.statistic), float(res.pvalue)


def _layer_series(metrics: pd.DataFrame, metric: str):
    """Yield (layer, steps, values) of the layer-level ``metric``, ordered by step."""
    sel = metrics[(metrics["head"] == -1) & (metrics["metric"] == metric)]
    for layer, grp in sel.groupby("layer", sort=True):
        grp = grp.groupby("step", as_index=False)["value"].mean().sort_values("step")
        yield int(layer), grp["step"].to_numpy(dtype=float), grp["value"].to_numpy(dtype=float)


def early_regime(steps: np.ndarray, values: np.ndarray, alpha: float = ALPHA) -> dict[str, float]:
    """Longest significant increasing prefix and what follows it (module docstring)."""
    n = len(values)
    out = {"regime_len": 0, "regime_end_step": float("nan"), "regime_p": float("nan"),
           "has_regime": False, "regime_is_whole_run": False, "suffix_n": 0,
           "suffix_rho": float("nan"), "suffix_p_decrease": float("nan"),
           "suffix_change": float("nan"), "declines": False, "decays": False}
    for k in range(n, MIN_PREFIX - 1, -1):
        mk = mann_kendall(values[:k])
        if mk["p_increase"] < alpha:
            out.update(regime_len=k, regime_end_step=float(steps[k - 1]),
                       regime_p=mk["p_increase"], has_regime=True, regime_is_whole_run=k == n)
            break
    k = out["regime_len"]
    if k and n - (k - 1) >= 2:
        tail_steps, tail = steps[k - 1:], values[k - 1:]
        rho, _ = _spearman(tail_steps, tail)
        mk = mann_kendall(tail)
        out.update(suffix_n=len(tail), suffix_rho=rho, suffix_p_decrease=mk["p_decrease"],
                   suffix_change=float(tail[-1] - tail[0]),
                   declines=bool(tail[-1] < tail[0]),
                   decays=bool(mk["p_decrease"] < alpha))
    return out


def trend_table(metrics: pd.DataFrame, alpha: float = ALPHA) -> pd.DataFrame:
    """Per layer and level: whole-run Spearman ρ / Mann–Kendall of the contrast against
    step, the early regime and the decay after it (one row per metric × layer)."""
    rows = []
    for metric, level in TREND_METRICS.items():
        for layer, steps, values in _layer_series(metrics, metric):
            rho, p_rho = _spearman(steps, values)
            mk = mann_kendall(values)
            rows.append({"metric": metric, "level": level, "layer": layer, "n": len(values),
                         "first_step": steps[0], "last_step": steps[-1],
                         "first": values[0], "last": values[-1], "rho": rho, "p_rho": p_rho,
                         "mk_s": mk["s"], "mk_z": mk["z"], "mk_tau": mk["tau"],
                         "mk_p_increase": mk["p_increase"], "mk_p_decrease": mk["p_decrease"],
                         "monotone_increase": bool(mk["p_increase"] < alpha),
                         "peak_step": float(steps[int(np.argmax(values))]),
                         **early_regime(steps, values, alpha)})
    return pd.DataFrame(rows)


def prefix_trends(metrics: pd.DataFrame) -> pd.DataFrame:
    """The prefix-trend curve: per metric × layer and prefix length k = 3 … n, Spearman ρ
    and Mann–Kendall Z / p_increase of the first k checkpoints."""
    rows = []
    for metric, level in TREND_METRICS.items():
        for layer, steps, values in _layer_series(metrics, metric):
            for k in range(3, len(values) + 1):
                rho, _ = _spearman(steps[:k], values[:k])
                mk = mann_kendall(values[:k])
                rows.append({"metric": metric, "level": level, "layer": layer, "k": k,
                             "end_step": steps[k - 1], "rho": rho, "mk_z": mk["z"],
                             "mk_p_increase": mk["p_increase"]})
    return pd.DataFrame(rows, columns=["metric", "level", "layer", "k", "end_step", "rho",
                                       "mk_z", "mk_p_increase"])


def head_correlations(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per checkpoint and level: Spearman ρ across heads of pr_qk with attention entropy,
    per layer and pooled over all layers' heads (``layer = −1``)."""
    heads = metrics[metrics["head"] >= 0]
    rows = []
    for level in ("weight", "token"):
        wide = heads[heads["metric"].isin([f"pr_qk_{level}", "attn_entropy"])].pivot_table(
            index=["checkpoint", "step", "layer", "head"], columns="metric", values="value")
        if wide.empty or f"pr_qk_{level}" not in wide:
            continue
        wide = wide.reset_index()
        for (ckpt, step), grp in wide.groupby(["checkpoint", "step"], sort=False):
            parts = [(int(layer), g) for layer, g in grp.groupby("layer")] + [(-1, grp)]
            for layer, g in parts:
                ok = g[[f"pr_qk_{level}", "attn_entropy"]].dropna()
                rho, p = _spearman(ok[f"pr_qk_{level}"].to_numpy(), ok["attn_entropy"].to_numpy())
                rows.append({"checkpoint": ckpt, "step": step, "level": level, "layer": layer,
                             "n_heads": len(ok), "rho": rho, "p": p})
    out = pd.DataFrame(rows, columns=["checkpoint", "step", "level", "layer", "n_heads", "rho",
                                      "p"])
    return out.sort_values(["level", "step", "layer"], kind="stable", ignore_index=True)
