"""Statistics of the E1/E2 claims on collated sweep tables (built on scipy.stats).

The unit of analysis is the paper's: a *trajectory* = one (depth, Q/K init, layer) at the
whole-layer level (head −1), averaged over seeds; every statistic is also available per
single run (``by="run"``). Each trend is measured twice (docs/definitions.md, "Reference
step and the two origins"): from step 0 and from the post-transient reference — the first
probed step at or after the run's ``ref_step`` (``reference_step``, or the end of LR
warm-up when it is −1) — and at both the weight and the token level.

Per trajectory, level and origin (``trajectory_stats``):

- ``delta_pr_q``/``delta_pr_k``: PR at the last probe minus PR at the origin (dimensions);
  ``slope_pr_q``/``slope_pr_k``: OLS slope of PR against step over the probes from the
  origin on (dimensions per step).
- ``contrast_pos_share``: share of probes *after* the origin with PR_Q − PR_K > 0;
  ``contrast_min_after``: the smallest contrast after the origin (> 0 ⟺ positive at every
  such probe); ``contrast_time_mean``: the time average of the contrast over [origin, end]
  (trapezoid rule, so an uneven probe schedule is weighted by time), and its sign.
- ``rho_k_qk``: Spearman ρ over steps (from the origin on) of PR_K with the interaction PR
  ``pr_qk``, computed within each run and averaged over seeds; ``rho_qk_entropy``: the same
  for ``pr_qk`` with the attention entropy. ``*_of_mean`` is ρ of the seed-averaged
  trajectory, and ``p_k_qk``/``p_qk_entropy`` its p-value (two-sided, t approximation, as
  scipy.stats.spearmanr); with ``by="run"`` the two coincide.
- ``rho_heads_qk_entropy``: Spearman ρ across the heads of the layer, at the last probe, of
  ``pr_qk`` with attention entropy, computed per run and averaged over seeds (head indices
  are arbitrary across seeds, so heads are never seed-averaged). It does not depend on the
  origin.

Across trajectories: :func:`count_test` (k of n with the predicted sign, exact one-sided
binomial / sign test, ``scipy.stats.binomtest``), :func:`bootstrap_ci` (seed bootstrap of
the across-trajectory mean), and :func:`verdict`, the one place the verdict rules live.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats as sst

LEVELS = ("weight", "token")
ORIGINS = ("step0", "reference")
TRAJECTORY = ["depth", "qk_init", "variant", "layer"]
_GROUP = ["depth", "qk_init", "variant"]

# Verdict rules (docs/report.md explains the choice). Written once, used by every claim.
ALPHA = 0.05  # one-sided sign-test level
SUPPORT_SHARE = 0.80  # predicted sign in at least this share of trajectories ...
FAIL_SHARE = 0.50  # ... not supported at or below this share (no better than a coin)
N_BOOT = 2000
BOOT_SEED = 0

# Statistics whose across-trajectory mean gets a seed-bootstrap CI.
# All are seed means of per-run quantities (E1: linear in the trajectory; ρ: per run), so the
# percentile interval is centred on the point estimate. (The minimum contrast is not: a
# resample with repeated seeds is noisier, so its min is biased; it gets no interval.)
BOOT_STATS = ("delta_pr_q", "delta_pr_k", "slope_pr_q", "slope_pr_k", "contrast_time_mean",
              "rho_k_qk", "rho_qk_entropy", "rho_heads_qk_entropy")


def level_metrics(level: str) -> dict[str, str]:
    """Metric names of one level: pr_q, pr_k, contrast, pr_qk, attn_entropy."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    return {"pr_q": f"pr_q_{level}", "pr_k": f"pr_k_{level}",
            "contrast": f"contrast_{level}", "pr_qk": f"pr_qk_{level}",
            "attn_entropy": "attn_entropy"}


# ---------------------------------------------------------------------------------------
# Single-trajectory building blocks (arrays; leading batch dimensions allowed)
# ---------------------------------------------------------------------------------------

def reference_probe(steps: Iterable[int], ref_step: int) -> int:
    """The first probed step ≥ ``ref_step`` (the post-transient reference); the
    last probed step if the run was never probed that late."""
    steps = sorted(int(s) for s in steps)
    if not steps:
        raise ValueError("no probe steps")
    later = [s for s in steps if s >= ref_step]
    return later[0] if later else steps[-1]


def ols_slope(steps: np.ndarray, values: np.ndarray) -> np.ndarray:
    """OLS slope of ``values`` (…, T) against ``steps`` (T,), along the last axis; NaN if
    fewer than two steps."""
    t = np.asarray(steps, dtype=float)
    x = np.asarray(values, dtype=float)
    if len(t) < 2:
        return np.full(x.shape[:-1], np.nan)
    tc = t - t.mean()
    return (x * tc).sum(-1) / (tc**2).sum()


def trend(steps: Iterable[int], values: Iterable[float], start_step: int = 0) -> dict[str, float]:
    """Change of one trajectory from the first probe ≥ ``start_step`` to the last probe:
    ``delta`` (end − start) and ``slope`` (OLS against step, over those probes)."""
    t = np.asarray(list(steps), dtype=float)
    x = np.asarray(list(values), dtype=float)
    order = np.argsort(t)
    t, x = t[order], x[order]
    keep = t >= reference_probe(t.astype(int), start_step)
    t, x = t[keep], x[keep]
    return {"start_step": int(t[0]), "end_step": int(t[-1]), "delta": float(x[-1] - x[0]),
            "slope": float(ols_slope(t, x))}


def spearman(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Spearman ρ of ``x`` and ``y`` along the last axis (average ranks for ties) and its
    two-sided p-value (t approximation with n − 2 df, as ``scipy.stats.spearmanr``).
    NaN where n < 3 for p, n < 2 or a constant series for ρ."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    n = x.shape[-1]
    if n < 2:
        nan = np.full(x.shape[:-1], np.nan)
        return nan, nan.copy()
    rx = sst.rankdata(x, axis=-1)
    ry = sst.rankdata(y, axis=-1)
    rx = rx - rx.mean(-1, keepdims=True)
    ry = ry - ry.mean(-1, keepdims=True)
    den = np.sqrt((rx**2).sum(-1) * (ry**2).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = np.where(den > 0, (rx * ry).sum(-1) / np.where(den > 0, den, 1.0), np.nan)
        rho = np.clip(rho, -1.0, 1.0)
        if n < 3:
            return rho, np.full(rho.shape, np.nan)
        df = n - 2
        tstat = rho * np.sqrt(df / ((1.0 + rho) * (1.0 - rho)))
        p = 2.0 * sst.t.sf(np.abs(tstat), df)
    return rho, np.where(np.isnan(rho), np.nan, p)


_trapezoid = getattr(np, "trapezoid", None) or np.trapz  # numpy < 2 has only trapz


def _time_mean(steps: np.ndarray, x: np.ndarray) -> np.ndarray:
    t = np.asarray(steps, dtype=float)
    if len(t) < 2 or t[-1] == t[0]:
        return x[..., 0].copy()
    return _trapezoid(x, t, axis=-1) / (t[-1] - t[0])


def window_stats(steps: np.ndarray, m: dict[str, np.ndarray], i0: int,
                 correlations: bool = True) -> dict[str, np.ndarray]:
    """Every per-trajectory statistic of one level from probe index ``i0`` to the end.

    ``m`` maps ``pr_q, pr_k, pr_qk, attn_entropy`` to arrays (…, T) (one run, seed means,
    or a batch of bootstrap resamples); returns arrays (…,). ``correlations=False`` skips
    the Spearman statistics."""
    t = np.asarray(steps, dtype=float)[i0:]
    q, k = m["pr_q"][..., i0:], m["pr_k"][..., i0:]
    c = q - k
    after = c[..., 1:]
    with np.errstate(invalid="ignore"):
        share = (after > 0).mean(-1) if after.shape[-1] else np.full(c.shape[:-1], np.nan)
        cmin = after.min(-1) if after.shape[-1] else np.full(c.shape[:-1], np.nan)
    tmean = _time_mean(t, c)
    out = {
        "pr_q_start": q[..., 0], "pr_q_end": q[..., -1],
        "pr_k_start": k[..., 0], "pr_k_end": k[..., -1],
        "delta_pr_q": q[..., -1] - q[..., 0], "delta_pr_k": k[..., -1] - k[..., 0],
        "slope_pr_q": ols_slope(t, q), "slope_pr_k": ols_slope(t, k),
        "contrast_start": c[..., 0], "contrast_end": c[..., -1],
        "contrast_pos_share": share, "contrast_min_after": cmin,
        "contrast_time_mean": tmean, "contrast_sign": np.sign(tmean),
    }
    if correlations:
        out["rho_k_qk"], out["p_k_qk"] = spearman(k, m["pr_qk"][..., i0:])
        out["rho_qk_entropy"], out["p_qk_entropy"] = spearman(m["pr_qk"][..., i0:],
                                                              m["attn_entropy"][..., i0:])
    return out


RHO_STATS = ("rho_k_qk", "rho_qk_entropy")


def _trajectory_window(grp: _Group, i0: int) -> dict[str, np.ndarray]:
    """Statistics of each trajectory (L,) of a group from probe ``i0``: E1 quantities of the
    seed-mean trajectory (they are linear in it, so equal to the seed mean of the per-run
    values, except the min); Spearman ρ per run, then averaged over seeds — a seed mean
    smooths noise, so ρ of the mean trajectory (kept as ``*_of_mean`` with its p) is not
    comparable across different numbers of seeds and would bias the seed bootstrap."""
    mean = {q: a.mean(axis=0) for q, a in grp.cube.items()}  # (L, T)
    st = window_stats(grp.steps, mean, i0)
    per_run = window_stats(grp.steps, grp.cube, i0)  # (S, L)
    for name in RHO_STATS:
        st[f"{name}_of_mean"] = st[name]
        st[name] = _nanmean(per_run[name], axis=0)
    return st


# ---------------------------------------------------------------------------------------
# Collated tables -> arrays per group
# ---------------------------------------------------------------------------------------

class _Group:
    """One seed-averaging group (or one run) at one level: arrays over (seed, layer, step)."""

    def __init__(self, key: dict[str, Any], runs: list[str], seeds: list[int],
                 layers: np.ndarray, steps: np.ndarray, ref: int,
                 cube: dict[str, np.ndarray], heads: dict[str, np.ndarray]):
        self.key, self.runs, self.seeds, self.layers = key, runs, seeds, layers
        self.steps, self.ref, self.cube, self.heads = steps, ref, cube, heads

    def origin_index(self, origin: str) -> int:
        if origin == "step0":
            return 0
        return int(np.searchsorted(self.steps, reference_probe(self.steps, self.ref)))


def _ref_steps(table: pd.DataFrame, ref_step: int | None) -> dict[str, int]:
    if ref_step is not None:
        return {rid: int(ref_step) for rid in table["run_id"].unique()}
    runs = table.attrs.get("runs") or []
    refs = {r["run_id"]: int(r["ref_step"]) for r in runs if r.get("ref_step") is not None}
    missing = set(table["run_id"].unique()) - set(refs)
    if missing:
        raise ValueError(f"no reference step known for runs {sorted(missing)[:3]}; collate the "
                         "sweep with qkgeom.analysis.collate or pass ref_step=")
    return refs


def _groups(table: pd.DataFrame, level: str, by: str, ref_step: int | None) -> list[_Group]:
    """Arrays (seed, layer, step) of the level's metrics for each group, on the probe steps
    every run of the group has (finite), plus (seed, layer, head) at the last such step."""
    if by not in ("trajectory", "run"):
        raise ValueError(f"by must be 'trajectory' or 'run', got {by!r}")
    names = level_metrics(level)
    wanted = [names[q] for q in ("pr_q", "pr_k", "pr_qk", "attn_entropy")]
    refs = _ref_steps(table, ref_step)
    sel = table[table["metric"].isin(wanted)]
    keys = _GROUP if by == "trajectory" else [*_GROUP, "run_id", "seed"]
    out = []
    for gkey, g in sel.groupby(keys, sort=True):
        key = dict(zip(keys, gkey, strict=True))
        runs = sorted(g["run_id"].unique(), key=lambda r: (g.loc[g.run_id == r, "seed"].iloc[0], r))
        seeds = [int(g.loc[g.run_id == r, "seed"].iloc[0]) for r in runs]
        lay = g[g["head"] == -1]
        layers = np.sort(lay["layer"].unique())
        steps_all = np.sort(lay["step"].unique())
        present = [m for m in wanted if (lay["metric"] == m).any()]
        wide = lay.pivot_table(index=["run_id", "layer", "step"], columns="metric",
                               values="value", aggfunc="mean")
        full = pd.MultiIndex.from_product([runs, layers, steps_all],
                                          names=["run_id", "layer", "step"])
        wide = wide.reindex(full).reindex(columns=wanted)
        shape = (len(runs), len(layers), len(steps_all))
        cube = {m: wide[m].to_numpy(dtype=float).reshape(shape) for m in wanted}
        ok = np.ones(len(steps_all), dtype=bool)
        for m in present:
            ok &= np.isfinite(cube[m]).all(axis=(0, 1))
        steps = steps_all[ok]
        if len(steps) == 0:
            continue
        cube = {q: cube[names[q]][..., ok] for q in ("pr_q", "pr_k", "pr_qk", "attn_entropy")}
        last = int(steps[-1])
        hd = g[(g["head"] >= 0) & (g["step"] == last)]
        heads_idx = np.sort(hd["head"].unique())
        hw = hd.pivot_table(index=["run_id", "layer", "head"], columns="metric", values="value",
                            aggfunc="mean")
        hw = hw.reindex(pd.MultiIndex.from_product([runs, layers, heads_idx])).reindex(
            columns=wanted)
        hshape = (len(runs), len(layers), len(heads_idx))
        heads = {q: hw[names[q]].to_numpy(dtype=float).reshape(hshape)
                 for q in ("pr_qk", "attn_entropy")}
        ref = min(refs[r] for r in runs)
        out.append(_Group(key, runs, seeds, layers, steps, ref, cube, heads))
    return out


def _heads_rho(group: _Group) -> tuple[np.ndarray, np.ndarray]:
    """Per run and layer: Spearman ρ across heads of pr_qk with entropy, (S, L) each."""
    return spearman(group.heads["pr_qk"], group.heads["attn_entropy"])


def trajectory_stats(table: pd.DataFrame, by: str = "trajectory",
                     levels: Iterable[str] = LEVELS,
                     ref_step: int | None = None) -> pd.DataFrame:
    """Per-trajectory E1/E2 statistics, one row per (trajectory, level, origin).

    ``table`` is :func:`qkgeom.analysis.collate`'s output (its ``attrs`` give each run's
    reference step; else pass ``ref_step``). ``by="trajectory"`` seed-averages runs that
    differ only by seed; ``by="run"`` keeps each run (adds ``run_id, seed``). Columns: the
    trajectory keys, ``level, origin, start_step, end_step, n_steps, n_seeds``, the
    statistics of :func:`window_stats` and ``rho_heads_qk_entropy`` (mean over seeds) with
    ``p_heads_qk_entropy`` (of a single run; NaN when averaged) and ``n_heads``.
    """
    rows = []
    for level in levels:
        for grp in _groups(table, level, by, ref_step):
            rho_h, p_h = _heads_rho(grp)  # (S, L)
            rho_heads = _nanmean(rho_h, axis=0)  # (L,)
            p_heads = p_h[0] if len(grp.runs) == 1 else np.full(len(grp.layers), np.nan)
            for origin in ORIGINS:
                i0 = grp.origin_index(origin)
                st = _trajectory_window(grp, i0)
                for j, layer in enumerate(grp.layers):
                    row = {**grp.key, "layer": int(layer), "level": level, "origin": origin,
                           "start_step": int(grp.steps[i0]), "end_step": int(grp.steps[-1]),
                           "n_steps": len(grp.steps) - i0, "n_seeds": len(grp.runs)}
                    row.update({name: float(v[j]) for name, v in st.items()})
                    row["rho_heads_qk_entropy"] = float(rho_heads[j])
                    row["p_heads_qk_entropy"] = float(p_heads[j])
                    row["n_heads"] = grp.heads["pr_qk"].shape[-1]
                    rows.append(row)
    cols = [*_GROUP, *(["run_id", "seed"] if by == "run" else []), "layer", "level", "origin"]
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    return out.sort_values(cols, kind="stable").reset_index(drop=True)


def bootstrap_ci(table: pd.DataFrame, n_boot: int = N_BOOT, rng_seed: int = BOOT_SEED,
                 levels: Iterable[str] = LEVELS, ci: float = 0.95,
                 ref_step: int | None = None,
                 statistics: Iterable[str] = BOOT_STATS) -> pd.DataFrame:
    """Seed-bootstrap CI of the across-trajectory mean of each statistic.

    One resample draws, independently in each (depth, init) group, as many runs as the group
    has, with replacement; re-averages the trajectories; recomputes each trajectory's
    statistic; and averages it over all trajectories (NaNs skipped). The CI is the
    percentile interval of ``n_boot`` resamples (fixed ``rng_seed``); NaN when every group
    has a single seed (nothing to resample). Rows: ``level, origin, statistic, mean,
    ci_low, ci_high, n_trajectories, n_boot``.
    """
    statistics = list(statistics)
    rows = []
    lo_q, hi_q = 100 * (1 - ci) / 2, 100 * (1 + ci) / 2
    for level in levels:
        rng = np.random.default_rng([rng_seed, LEVELS.index(level)])
        groups = _groups(table, level, "trajectory", ref_step)
        resamplable = any(len(g.runs) > 1 for g in groups)  # else every resample is the same
        point: dict[tuple[str, str], list[np.ndarray]] = {}
        boots: dict[tuple[str, str], list[np.ndarray]] = {}
        for grp in groups:
            S = len(grp.runs)
            idx = rng.integers(0, S, size=(n_boot, S))  # (B, S)
            rho_h, _ = _heads_rho(grp)  # (S, L)
            for origin in ORIGINS:
                i0 = grp.origin_index(origin)
                st = _trajectory_window(grp, i0)
                bt = _boot_window_stats(grp, idx, i0)
                # seed means of per-run values: resampling seeds resamples those values
                per_run = window_stats(grp.steps, grp.cube, i0)  # (S, L)
                per_run["rho_heads_qk_entropy"] = rho_h
                st["rho_heads_qk_entropy"] = _nanmean(rho_h, axis=0)
                for name in RHO_STATS + ("rho_heads_qk_entropy",):
                    bt[name] = _nanmean(per_run[name][idx], axis=1)  # (B, L)
                for name in statistics:
                    p, b = st[name], bt[name]
                    point.setdefault((origin, name), []).append(p)
                    boots.setdefault((origin, name), []).append(b)
        for origin in ORIGINS:
            for name in statistics:
                if (origin, name) not in point:
                    continue
                p = np.concatenate(point[(origin, name)])  # (n_traj,)
                b = np.concatenate(boots[(origin, name)], axis=1)  # (B, n_traj)
                bm = _nanmean(b, axis=1)
                bm = bm[np.isfinite(bm)] if resamplable else bm[:0]
                rows.append({
                    "level": level, "origin": origin, "statistic": name,
                    "mean": float(_nanmean(p, axis=0)) if np.isfinite(p).any() else np.nan,
                    "ci_low": float(np.percentile(bm, lo_q)) if len(bm) else np.nan,
                    "ci_high": float(np.percentile(bm, hi_q)) if len(bm) else np.nan,
                    "n_trajectories": int(np.isfinite(p).sum()), "n_boot": n_boot,
                })
    return pd.DataFrame(rows)


def _nanmean(x: np.ndarray, axis: int) -> np.ndarray:
    finite = np.isfinite(x)
    n = finite.sum(axis=axis)
    s = np.where(finite, x, 0.0).sum(axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, s / np.maximum(n, 1), np.nan)


def _boot_window_stats(grp: _Group, idx: np.ndarray, i0: int,
                       chunk: int = 250) -> dict[str, np.ndarray]:
    """window_stats of every bootstrap resample: arrays (B, L), computed in chunks of B."""
    parts: dict[str, list[np.ndarray]] = {}
    for start in range(0, len(idx), chunk):
        sub = idx[start:start + chunk]  # (b, S)
        mean = {q: a[sub].mean(axis=1) for q, a in grp.cube.items()}  # (b, L, T)
        for name, v in window_stats(grp.steps, mean, i0, correlations=False).items():
            parts.setdefault(name, []).append(v)
    return {name: np.concatenate(v, axis=0) for name, v in parts.items()}


# ---------------------------------------------------------------------------------------
# Across trajectories: counts, sign test, verdict
# ---------------------------------------------------------------------------------------

def binomial_p(k: int, n: int) -> float:
    """Exact one-sided binomial (sign-test) p-value of ≥ k successes in n under p = ½."""
    if n <= 0:
        return float("nan")
    return float(sst.binomtest(int(k), int(n), 0.5, alternative="greater").pvalue)


def count_test(values: Iterable[float], predicted_sign: int = 1) -> dict[str, float]:
    """How many finite ``values`` have the predicted sign (strictly: a zero counts against),
    with the exact one-sided sign-test p-value. NaNs are not counted in n."""
    if predicted_sign not in (1, -1):
        raise ValueError("predicted_sign must be +1 or -1")
    v = np.asarray(list(values), dtype=float)
    v = v[np.isfinite(v)]
    k = int((np.sign(v) == predicted_sign).sum())
    n = len(v)
    return {"k": k, "n": n, "share": k / n if n else float("nan"), "p_value": binomial_p(k, n)}


def verdict(k: int, n: int, p_value: float, universal: bool = False) -> str:
    """The verdict of a claim from its count and sign-test p-value.

    - ``not evaluated``: no trajectory could be measured (n = 0);
    - ``supported``: the predicted sign in ≥ 80 % of trajectories (in all of them for a
      universal claim such as "in all trajectories") and one-sided p < 0.05;
    - ``not supported``: the predicted sign in ≤ 50 % (no better than a coin);
    - ``mixed``: anything in between, including a clear majority that is too small a
      sample for p < 0.05.
    """
    if n == 0:
        return "not evaluated"
    share = k / n
    if share <= FAIL_SHARE:
        return "not supported"
    strong = (k == n) if universal else (share >= SUPPORT_SHARE)
    if strong and p_value < ALPHA:
        return "supported"
    return "mixed"
