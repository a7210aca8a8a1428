"""E1/E2 statistics of each layer trajectory (one layer's whole-layer value, head −1,
against probe step), per run and seed-averaged, and per run: the independent unit.

Each is measured from step 0 and from the post-transient reference, at the weight and the
token level, in one pass over each depth × init cell (its runs as a seed axis); E2's
cross-run null pairs the runs of one depth and setting across cells. Every column, and why
E2.1/E2.2 read the probe-to-probe changes against that null and seed-averaged ρ's are means
of per-run ρ's: docs/report.md (E1/E2 statistics).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from qkgeom.analysis.collate import GROUP, Collated
from qkgeom.analysis.stats import nanmean, spearman, spearman_cross

LEVELS = ("weight", "token")
ORIGINS = ("step0", "reference")
QUANTITIES = ("pr_q", "pr_k", "pr_qk", "attn_entropy")
RHO_STATS = ("rho_k_qk", "rho_qk_entropy", "rho_k_qk_levels", "rho_qk_entropy_levels")
#: E2.1/E2.2 on the changes: the within-run ρ (:data:`RHO_STATS`) and the quantities whose
#: changes it correlates; E2's null (protocol 2) pairs run i's first with run j's second.
E2_PAIRS = {"rho_k_qk": ("pr_k", "pr_qk"), "rho_qk_entropy": ("pr_qk", "attn_entropy")}
#: Per ρ of :data:`E2_PAIRS`: the cross-run null and the within-run ρ minus it (primary).
NULL_STATS = tuple(f"{name}_{kind}" for name in E2_PAIRS for kind in ("null", "vs_null"))
#: The per-layer statistics averaged into a run's whole-model value.
STATISTICS = ("delta_pr_q", "delta_pr_k", "slope_pr_q", "slope_pr_k", "contrast_min_after",
              "contrast_end", "contrast_time_mean", "delta_contrast", "contrast_pos_share",
              *RHO_STATS, *NULL_STATS, "rho_heads_qk_entropy")


def level_metrics(level: str) -> dict[str, str]:
    """Metric names of one level: pr_q, pr_k, contrast, pr_qk, attn_entropy."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    return {"pr_q": f"pr_q_{level}", "pr_k": f"pr_k_{level}",
            "contrast": f"contrast_{level}", "pr_qk": f"pr_qk_{level}",
            "attn_entropy": "attn_entropy"}


def reference_probe(steps: Iterable[int], ref_step: int) -> int:
    """The first probed step ≥ ``ref_step`` (the post-transient reference); the last
    probed step if the run was never probed that late."""
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


_trapezoid = getattr(np, "trapezoid", None) or np.trapz  # numpy < 2 has only trapz


def time_mean(steps: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Time average of ``x`` (…, T) over [steps[0], steps[-1]] by the trapezoid rule, so an
    uneven probe schedule is weighted by time; the first value for a single probe."""
    t = np.asarray(steps, dtype=float)
    if len(t) < 2 or t[-1] == t[0]:
        return x[..., 0].copy()
    return _trapezoid(x, t, axis=-1) / (t[-1] - t[0])


def window_stats(steps: np.ndarray, m: dict[str, np.ndarray], i0: int) -> dict[str, np.ndarray]:
    """Every per-trajectory statistic of one level from probe index ``i0`` to the end.

    ``m`` maps ``pr_q, pr_k, pr_qk, attn_entropy`` to arrays (…, T) (runs × layers, or a
    seed-mean); returns arrays (…,)."""
    t = np.asarray(steps, dtype=float)[i0:]
    q, k = m["pr_q"][..., i0:], m["pr_k"][..., i0:]
    c = q - k
    after = c[..., 1:]
    with np.errstate(invalid="ignore"):
        share = (after > 0).mean(-1) if after.shape[-1] else np.full(c.shape[:-1], np.nan)
        cmin = after.min(-1) if after.shape[-1] else np.full(c.shape[:-1], np.nan)
    out = {
        "pr_q_start": q[..., 0], "pr_q_end": q[..., -1],
        "pr_k_start": k[..., 0], "pr_k_end": k[..., -1],
        "delta_pr_q": q[..., -1] - q[..., 0], "delta_pr_k": k[..., -1] - k[..., 0],
        "slope_pr_q": ols_slope(t, q), "slope_pr_k": ols_slope(t, k),
        "contrast_start": c[..., 0], "contrast_end": c[..., -1],
        "contrast_pos_share": share, "contrast_min_after": cmin,
        "contrast_time_mean": time_mean(t, c), "delta_contrast": c[..., -1] - c[..., 0],
    }
    qk, ent = m["pr_qk"][..., i0:], m["attn_entropy"][..., i0:]
    out["rho_k_qk"], out["p_k_qk"] = spearman(np.diff(k, axis=-1), np.diff(qk, axis=-1))
    out["rho_qk_entropy"], out["p_qk_entropy"] = spearman(np.diff(qk, axis=-1),
                                                          np.diff(ent, axis=-1))
    out["rho_k_qk_levels"], _ = spearman(k, qk)
    out["rho_qk_entropy_levels"], _ = spearman(qk, ent)
    return out


@dataclass(frozen=True)
class _Cell:
    """One depth × init (× variant) cell at one level: arrays over (run, layer, step) on the
    probe steps every run of the cell has, and (run, layer, head) at the last of them."""

    key: dict[str, Any]
    runs: list[str]
    seeds: list[int]
    layers: np.ndarray
    steps: np.ndarray
    ref: int
    cube: dict[str, np.ndarray]
    heads: dict[str, np.ndarray]

    def origin_index(self, origin: str) -> int:
        if origin == "step0":
            return 0
        return int(np.searchsorted(self.steps, reference_probe(self.steps, self.ref)))


def _dense(frame: pd.DataFrame, axes: list[tuple[str, Any]]) -> np.ndarray:
    """``frame["value"]`` as a dense array over the given (column, labels) axes; the mean
    where a cell has several rows, NaN where it has none; rows off the labels are dropped."""
    idx = [pd.Index(labels).get_indexer(frame[col].to_numpy()) for col, labels in axes]
    keep = np.logical_and.reduce([i >= 0 for i in idx])
    idx = tuple(i[keep] for i in idx)
    shape = tuple(len(labels) for _, labels in axes)
    total, count = np.zeros(shape), np.zeros(shape)
    np.add.at(total, idx, frame["value"].to_numpy(dtype=float)[keep])
    np.add.at(count, idx, 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1.0), np.nan)


def _cells(data: Collated, level: str) -> list[_Cell]:
    """The cells of ``data`` at ``level`` (see :class:`_Cell`); a cell with no step that
    every run measured is left out."""
    names = level_metrics(level)
    wanted = [names[q] for q in QUANTITIES]
    refs = data.ref_steps
    sel = data.metrics[data.metrics["metric"].isin(wanted)]
    out = []
    for gkey, g in sel.groupby(GROUP, sort=True):
        key = dict(zip(GROUP, gkey, strict=True))
        first_seed = g.groupby("run_id")["seed"].first()
        runs = sorted(first_seed.index, key=lambda r: (first_seed[r], r))
        seeds = [int(first_seed[r]) for r in runs]
        lay = g[g["head"] == -1]
        layers = np.sort(lay["layer"].unique())
        steps_all = np.sort(lay["step"].unique())
        recorded = set(lay["metric"].unique())
        present = [i for i, m in enumerate(wanted) if m in recorded]
        dense = _dense(lay, [("metric", wanted), ("run_id", runs), ("layer", layers),
                             ("step", steps_all)])  # (metric, run, layer, step)
        # the steps at which every recorded metric of every run and layer is finite
        ok = np.isfinite(dense[present]).all(axis=(0, 1, 2))
        steps = steps_all[ok]
        if len(steps) == 0:
            continue
        cube = {q: dense[wanted.index(names[q])][..., ok] for q in QUANTITIES}
        hd = g[(g["head"] >= 0) & (g["step"] == int(steps[-1]))]
        pair = [names["pr_qk"], names["attn_entropy"]]
        hdense = _dense(hd, [("metric", pair), ("run_id", runs), ("layer", layers),
                             ("head", np.sort(hd["head"].unique()))])
        heads = {"pr_qk": hdense[0], "attn_entropy": hdense[1]}
        ref = min(refs[r] for r in runs)
        out.append(_Cell(key, runs, seeds, layers, steps, ref, cube, heads))
    return out


def cross_run_null(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """E2's null (docs/protocols.md#e2): for runs i of one depth and setting, ``x`` and
    ``y`` (runs, layers, changes), the mean over the other runs j of ρ(x[i], y[j]) per run
    and layer (runs, layers): what a profile every run shares gives with no link inside a
    run. NaN for a run with no other run (or none with a defined ρ)."""
    rho = spearman_cross(x, y)  # (i, j, layer)
    n = rho.shape[0]
    rho[np.arange(n), np.arange(n)] = np.nan  # the within-run pairs are not the null
    return nanmean(rho, axis=1)


def _null_stats(cells: list[_Cell], origin: str) -> dict[int, dict[str, np.ndarray]]:
    """:data:`NULL_STATS` per cell index (arrays run × layer) at ``origin``, the null of
    each run from the runs of every cell of its depth and setting (variant) with the same
    layers and the same probe steps from the origin: the Q/K inits are pooled."""
    groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for ci, cell in enumerate(cells):
        i0 = cell.origin_index(origin)
        key = (cell.key["depth"], cell.key["variant"], tuple(cell.layers.tolist()),
               tuple(cell.steps[i0:].tolist()))
        groups[key].append((ci, i0))
    out: dict[int, dict[str, np.ndarray]] = {ci: {} for ci in range(len(cells))}
    for members in groups.values():
        sizes = [len(cells[ci].runs) for ci, _ in members]
        bounds = np.cumsum([0, *sizes])
        for name, (a, b) in E2_PAIRS.items():
            x = np.concatenate([np.diff(cells[ci].cube[a][..., i0:], axis=-1)
                                for ci, i0 in members])
            y = np.concatenate([np.diff(cells[ci].cube[b][..., i0:], axis=-1)
                                for ci, i0 in members])
            null = cross_run_null(x, y)
            within, _ = spearman(x, y)
            for m, (ci, _) in enumerate(members):
                part = slice(bounds[m], bounds[m + 1])
                out[ci][f"{name}_null"] = null[part]
                out[ci][f"{name}_vs_null"] = within[part] - null[part]
    return out


def layer_statistics(data: Collated, levels: Iterable[str] = LEVELS
                     ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(per run and layer, per seed-averaged layer trajectory)`` of :func:`collate`'s
    result: one row per layer, level and origin, with the cell keys, ``layer, level,
    origin, start_step, end_step, n_steps, n_heads`` and the statistics; the per-run frame
    adds ``run_id, seed``, the trajectory frame ``n_seeds``, ``*_of_mean`` ρ's with their
    p-values."""
    run_rows: list[dict[str, Any]] = []
    traj_rows: list[dict[str, Any]] = []
    for level in levels:
        cells = _cells(data, level)
        nulls = {origin: _null_stats(cells, origin) for origin in ORIGINS}
        for ci, cell in enumerate(cells):
            rho_h, _ = spearman(cell.heads["pr_qk"], cell.heads["attn_entropy"])  # (S, L)
            n_heads = cell.heads["pr_qk"].shape[-1]
            mean_cube = {q: a.mean(axis=0) for q, a in cell.cube.items()}  # (L, T)
            for origin in ORIGINS:
                i0 = cell.origin_index(origin)
                per_run = window_stats(cell.steps, cell.cube, i0)  # (S, L)
                per_run["rho_heads_qk_entropy"] = rho_h
                per_run.update(nulls[origin][ci])
                mean = window_stats(cell.steps, mean_cube, i0)  # (L,)
                for name in RHO_STATS:
                    mean[f"{name}_of_mean"] = mean[name]
                    mean[name] = nanmean(per_run[name], axis=0)
                for name in NULL_STATS:
                    mean[name] = nanmean(per_run[name], axis=0)
                mean["rho_heads_qk_entropy"] = nanmean(rho_h, axis=0)
                common = {"level": level, "origin": origin, "start_step": int(cell.steps[i0]),
                          "end_step": int(cell.steps[-1]), "n_steps": len(cell.steps) - i0,
                          "n_heads": n_heads}
                for j, layer in enumerate(cell.layers):
                    row = {**cell.key, "layer": int(layer), **common}
                    traj_rows.append({**row, "n_seeds": len(cell.runs),
                                      **{n: float(v[j]) for n, v in mean.items()}})
                    for s, (run, seed) in enumerate(zip(cell.runs, cell.seeds, strict=True)):
                        run_rows.append({**row, "run_id": run, "seed": seed,
                                         **{n: float(v[s, j]) for n, v in per_run.items()}})
    keys = [*GROUP, "layer", "level", "origin"]
    return (_sorted(pd.DataFrame(run_rows), [*GROUP, "run_id", "seed", "layer", "level",
                                             "origin"]),
            _sorted(pd.DataFrame(traj_rows), keys))


def _sorted(frame: pd.DataFrame, cols: list[str]) -> pd.DataFrame:
    if frame.empty:
        return frame
    return frame.sort_values(cols, kind="stable").reset_index(drop=True)


def run_stats(per_layer: pd.DataFrame) -> pd.DataFrame:
    """The independent unit: one row per run, level and origin, every statistic of
    :data:`STATISTICS` the mean over the run's layers (NaN layers skipped), with
    ``n_layers`` and the smallest ``n_heads`` of the run."""
    keys = [*GROUP, "run_id", "seed", "level", "origin"]
    if per_layer.empty:
        return pd.DataFrame(columns=[*keys, *STATISTICS, "n_layers", "n_heads"])
    g = per_layer.groupby(keys, sort=True, dropna=False)
    out = g[list(STATISTICS)].mean()
    out["n_layers"] = g["layer"].nunique()
    out["n_heads"] = g["n_heads"].min()
    out["start_step"] = g["start_step"].min()
    out["end_step"] = g["end_step"].max()
    return out.reset_index()


def cell_stats(runs: pd.DataFrame) -> pd.DataFrame:
    """Seed means of :func:`run_stats` per depth × init cell (9 on the paper grid), with
    ``n_runs``: a coarser independent unit shown beside the runs."""
    keys = [*GROUP, "level", "origin"]
    if runs.empty:
        return pd.DataFrame(columns=[*keys, *STATISTICS, "n_runs"])
    g = runs.groupby(keys, sort=True, dropna=False)
    out = g[list(STATISTICS)].mean()
    out["n_runs"] = g["run_id"].nunique()
    return out.reset_index()


#: The references of the sensitivity table: every probe from 5 % to 75 % of the run
#: (docs/protocols.md#reference-sensitivity).
SENSITIVITY_SHARES = (0.05, 0.75)


def reference_sensitivity(data: Collated, levels: Iterable[str] = LEVELS,
                          shares: tuple[float, float] = SENSITIVITY_SHARES) -> pd.DataFrame:
    """E1.1's and E1.2's run-level effects with the reference moved to every probe from
    ``shares[0]`` to ``shares[1]`` of the run: one row per run, level and reference with
    the cell keys, ``run_id, seed, level, reference_step, share`` (of the run's steps),
    ``primary`` (the protocol's reference) and ``delta_pr_q``, ``delta_pr_k`` (last probe
    − reference, mean over the run's layers, as :func:`run_stats` gives them)."""
    inc = data.included
    run_steps = dict(zip(inc["run_id"], inc["steps"], strict=True)) if len(inc) else {}
    rows: list[dict[str, Any]] = []
    for level in levels:
        for cell in _cells(data, level):
            length = max((int(run_steps.get(r, 0) or 0) for r in cell.runs), default=0)
            length = length if length > 0 else int(cell.steps[-1])
            lo, hi = shares[0] * length, shares[1] * length
            primary = reference_probe(cell.steps, cell.ref)
            q, k = cell.cube["pr_q"], cell.cube["pr_k"]  # (S, L, T)
            for i, step in enumerate(cell.steps[:-1]):  # the last probe measures no change
                if not lo <= step <= hi:
                    continue
                dq = nanmean(q[..., -1] - q[..., i], axis=1)
                dk = nanmean(k[..., -1] - k[..., i], axis=1)
                for s, (run, seed) in enumerate(zip(cell.runs, cell.seeds, strict=True)):
                    rows.append({**cell.key, "run_id": run, "seed": seed, "level": level,
                                 "reference_step": int(step), "share": step / length,
                                 "primary": int(step) == primary,
                                 "delta_pr_q": float(dq[s]), "delta_pr_k": float(dk[s])})
    cols = [*GROUP, "run_id", "seed", "level", "reference_step", "share", "primary",
            "delta_pr_q", "delta_pr_k"]
    return _sorted(pd.DataFrame(rows, columns=cols),
                   [*GROUP, "level", "reference_step", "seed", "run_id"])
