"""Trajectory statistics over a family of checkpoints (numpy + scipy, no torch).

Unit: one layer of one model (head −1), a contrast PR_Q − PR_K against checkpoint step
(:data:`TREND_METRICS`; the primary is the head-mean token contrast, fair under
grouped-query attention). Per layer: the regime call (:mod:`.regime`), Mann–Kendall and
Spearman over the rule's window and over growing prefixes (descriptive), and per
checkpoint the across-head ρ of pr_qk with entropy (E4.4). Mann–Kendall is written out:
scipy has none, and this one runs on every layer at once. Definitions: docs/protocols.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats as sst

from qkgeom.analysis.e4.regime import (
    CALLS,
    RISE_FALL,
    drift_variance,
    regime_calls,
    roughness,
    token_deviations,
)
from qkgeom.analysis.stats import ALPHA, spearman

__all__ = ["CALLS", "PRIMARY", "TREND_METRICS", "Drift", "block_cube", "drift_over_seeds",
           "head_correlations", "layer_series", "mann_kendall", "mann_kendall_batch",
           "prefix_trends", "rule_window", "trajectories", "trend_table"]

#: metric -> level label; the first is the primary layer contrast.
TREND_METRICS = {"contrast_token_heads": "token_heads", "contrast_token": "token",
                 "contrast_weight": "weight", "contrast_token_post": "token_post"}
PRIMARY = "contrast_token_heads"
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


def block_cube(blocks: pd.DataFrame | None, metric: str, layers: list[int], steps: np.ndarray
               ) -> np.ndarray | None:
    """The layer-level ``metric`` of every token block, (layers, K, n) on ``steps`` in the
    order of ``layers``; NaN where a block, layer or step is missing (that layer then gets
    no token noise). None without per-block rows."""
    if blocks is None or blocks.empty:
        return None
    sel = blocks[(blocks["head"] == -1) & (blocks["metric"] == metric)]
    if sel.empty:
        return None
    ids = np.array(sorted(sel["block"].unique()))
    wide = sel.pivot_table(index=["layer", "block"], columns="step", values="value",
                           aggfunc="mean").reindex(columns=steps)
    wide = wide.reindex(pd.MultiIndex.from_product([layers, ids]))
    return wide.to_numpy(dtype=float).reshape(len(layers), len(ids), len(steps))


def rule_window(steps: np.ndarray, warmup: int | None) -> np.ndarray:
    """Which checkpoints the regime rule reads: those at or after the end of the LR warm-up
    (step ≥ ``warmup``), every one when the warm-up is not known (None)."""
    steps = np.asarray(steps, dtype=float)
    return np.ones(len(steps), dtype=bool) if warmup is None else steps >= warmup


@dataclass(frozen=True)
class Trajectories:
    """The layer-level series of one contrast: ``x`` (layers, n) on every checkpoint
    ``steps`` (NaN where a layer lacks one), ``blocks`` (layers, K, n) or None, and
    ``window`` (n,): the checkpoints the regime rule reads."""

    metric: str
    layers: list[int]
    steps: np.ndarray
    x: np.ndarray
    blocks: np.ndarray | None
    window: np.ndarray


def trajectories(metrics: pd.DataFrame, blocks: pd.DataFrame | None, metric: str,
                 warmup: int | None = None) -> Trajectories | None:
    """The :class:`Trajectories` of ``metric`` (None when it is not recorded)."""
    series = list(layer_series(metrics, metric))
    if not series:
        return None
    steps = np.array(sorted({float(s) for _, st, _ in series for s in st}))
    layers = [layer for layer, _, _ in series]
    x = np.vstack([pd.Series(v, index=st).reindex(steps).to_numpy(dtype=float)
                   for _, st, v in series])
    return Trajectories(metric, layers, steps, x, block_cube(blocks, metric, layers, steps),
                        rule_window(steps, warmup))


#: The random walk's step variance per (contrast metric, layer), from the seeds of a set
#: (:func:`drift_over_seeds`); a layer it does not hold gets no walk.
Drift = dict[tuple[str, int], float]


def drift_over_seeds(units: list[tuple[pd.DataFrame, pd.DataFrame | None, int | None]]
                     ) -> Drift:
    """The step variance of a random walk within each run per contrast and layer
    (:func:`~qkgeom.analysis.e4.regime.drift_variance`), from the seeds' ``(metrics,
    blocks, warmup)`` on the checkpoints of the regime rule that every seed has (the
    seeds' mean curve is what they share; what is left varies between them)."""
    out: Drift = {}
    for metric in TREND_METRICS:
        trs = [trajectories(m, b, metric, w) for m, b, w in units]
        if any(tr is None for tr in trs):
            continue
        common = set.intersection(*({float(s) for s in tr.steps[tr.window]} for tr in trs))
        steps = np.array(sorted(common))
        for layer in set.intersection(*(set(tr.layers) for tr in trs)):
            xs, devs = [], []
            for tr in trs:
                cols = np.searchsorted(tr.steps, steps)
                i = tr.layers.index(layer)
                xs.append(tr.x[i, cols])
                cube = None if tr.blocks is None else tr.blocks[i:i + 1][..., cols]
                devs.append(token_deviations(cube, 1, len(steps))[0])
            dev = np.stack(devs) if len({d.shape[0] for d in devs}) == 1 else None
            out[(metric, int(layer))] = drift_variance(np.vstack(xs), dev)
    return out


def _warmup_peak(steps: np.ndarray, x: np.ndarray, window: np.ndarray, v: float
                 ) -> tuple[float, float, float]:
    """``(step, excess, excess in noise sd's)`` of the largest checkpoint inside the
    warm-up, the excess over the first checkpoint of the rule (descriptive: a regime that
    peaks inside the warm-up reads as a fall in the rule); NaN without both."""
    inside = ~window & np.isfinite(x)
    rule = np.flatnonzero(window & np.isfinite(x))
    if not inside.any() or not len(rule):
        return np.nan, np.nan, np.nan
    j = np.flatnonzero(inside)[int(np.argmax(x[inside]))]
    excess = float(x[j] - x[rule[0]])
    sd = float(np.sqrt(v)) if np.isfinite(v) and v > 0 else np.nan
    return float(steps[j]), excess, excess / sd if np.isfinite(sd) else np.nan


def trend_table(metrics: pd.DataFrame, blocks: pd.DataFrame | None = None,
                warmup: int | None = None, alpha: float = ALPHA,
                drift: Drift | None = None) -> pd.DataFrame:
    """Per contrast metric and layer, on the checkpoints after the LR warm-up (all when
    ``warmup`` is None): the regime call (:mod:`qkgeom.analysis.e4.regime`) from the
    all-token series and the per-block rows ``blocks`` (its noise), with the random walk of
    ``drift`` (a set's :func:`drift_over_seeds`; None: no walk, one model), the
    whole-window trend (Spearman ρ, Mann–Kendall; descriptive), ``n`` (checkpoints in the
    rule) and ``n_warmup`` (before it: shown, not tested), the warm-up's largest checkpoint
    (``warmup_peak_step``, ``warmup_excess`` over the rule's first, ``warmup_excess_z`` in
    the series' noise sd; descriptive). Also ``has_regime`` (rise then fall),
    ``regime_end_step`` (its peak step) and ``decays`` (a significant drop)."""
    rows = []
    for metric, level in TREND_METRICS.items():
        tr = trajectories(metrics, blocks, metric, warmup)
        if tr is None:
            continue
        window = tr.steps[tr.window]
        x = tr.x[:, tr.window]
        cube = tr.blocks[..., tr.window] if tr.blocks is not None else None
        q = None if drift is None else np.array(
            [drift.get((metric, int(layer)), 0.0) for layer in tr.layers])
        regime = regime_calls(x, cube, alpha, drift=q)
        noise = roughness(x)
        for i, layer in enumerate(tr.layers):
            ok = np.isfinite(x[i])
            w, v = window[ok], x[i][ok]
            rho, p_rho = _spearman1(w, v)
            mk = mann_kendall(v)
            r = regime.row(i)
            peak_step = float(window[int(r["peak"])]) if len(w) else float("nan")
            call = str(r["call"])
            wp_step, wp_excess, wp_z = _warmup_peak(tr.steps, tr.x[i], tr.window, noise[i])
            rows.append({"metric": metric, "level": level, "layer": layer, "n": len(v),
                         "n_warmup": int((np.isfinite(tr.x[i]) & ~tr.window).sum()),
                         "first_step": w[0] if len(w) else np.nan,
                         "last_step": w[-1] if len(w) else np.nan,
                         "first": v[0] if len(v) else np.nan,
                         "peak": x[i][int(r["peak"])] if len(w) else np.nan,
                         "last": v[-1] if len(v) else np.nan, "peak_step": peak_step,
                         "gain": r["gain"], "drop": r["drop"], "call": call,
                         "p_rise": r["p_rise"], "p_fall": r["p_fall"],
                         "z_rise": r["z_rise"], "z_fall": r["z_fall"],
                         "share_lost": r["share_lost"], "token_sd": r["token_sd"],
                         "jitter_sd": r["jitter_sd"], "drift_sd": r["drift_sd"],
                         "warmup_peak_step": wp_step, "warmup_excess": wp_excess,
                         "warmup_excess_z": wp_z, "rho": rho, "p_rho": p_rho,
                         "mk_s": mk["s"], "mk_z": mk["z"], "mk_tau": mk["tau"],
                         "mk_p_increase": mk["p_increase"], "mk_p_decrease": mk["p_decrease"],
                         "has_regime": call == RISE_FALL,
                         "regime_end_step": peak_step if call == RISE_FALL else float("nan"),
                         "decays": bool(r["p_fall"] < alpha)})
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
