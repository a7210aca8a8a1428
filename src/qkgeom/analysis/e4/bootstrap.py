"""The token-block bootstrap of the E4 regime calls (descriptive; docs/protocols.md).

``qkgeom analyze --blocks K`` measures every checkpoint on all tokens (``block = −1``) and
on K contiguous token blocks (``block = 0 … K−1``, the same blocks at every checkpoint).
One resample draws K blocks with replacement (:data:`N_BOOT` resamples, a fixed seed);
a layer's trajectory is then the mean over the drawn blocks of their contrasts at each
checkpoint, and its regime call and share of the gain lost are recomputed
(:func:`qkgeom.analysis.e4.trends.regime_calls`). Reported per layer: the share of
resamples giving each call, and percentile intervals of the share lost and of the peak
step; per checkpoint, a percentile band of the trajectory (the figure). With 8 blocks of
one text this describes how much the call depends on which tokens were read; it is not a
test over independent units.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis.e4.trends import CALLS, MONOTONE, PRIMARY, TREND_METRICS, regime_calls

N_BOOT = 2000
BOOT_SEED = 0
CI = (2.5, 97.5)


def block_cube(blocks: pd.DataFrame, metric: str, steps: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(layers, cube)``: the layer-level ``metric`` of every block, cube (L, K, n) on
    ``steps``; layers missing a block or a step are left out."""
    sel = blocks[(blocks["head"] == -1) & (blocks["metric"] == metric)]
    if sel.empty:
        return np.array([], dtype=int), np.zeros((0, 0, len(steps)))
    wide = sel.pivot_table(index=["layer", "block"], columns="step", values="value",
                           aggfunc="mean").reindex(columns=steps)
    layers = np.array(sorted(sel["layer"].unique()))
    ids = np.array(sorted(sel["block"].unique()))
    wide = wide.reindex(pd.MultiIndex.from_product([layers, ids]))
    cube = wide.to_numpy(dtype=float).reshape(len(layers), len(ids), len(steps))
    ok = np.isfinite(cube).all(axis=(1, 2))
    return layers[ok], cube[ok]


def block_bootstrap(blocks: pd.DataFrame, steps: np.ndarray, metric: str = PRIMARY,
                    n_boot: int = N_BOOT, seed: int = BOOT_SEED
                    ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(per layer, band)`` of the block bootstrap of ``metric`` on the checkpoints
    ``steps`` (in order). Per layer: ``metric, level, layer, n_blocks, n_boot``, the share
    of resamples per call (``share_<call>``), ``share_lost_low/high`` and
    ``peak_step_low/high`` (percentile intervals; the share lost over resamples that have a
    gain), and ``share_any_not_monotone`` (the same on every row: the share of resamples
    in which at least one layer is not a monotone rise; one resample draws the same blocks
    for every layer). Band: ``layer, step, low, high`` per checkpoint. Empty frames
    without blocks."""
    layers, cube = block_cube(blocks, metric, steps)
    if len(layers) == 0 or cube.shape[1] < 2:
        return pd.DataFrame(), pd.DataFrame()
    k = cube.shape[1]
    idx = np.random.default_rng(seed).integers(0, k, size=(n_boot, k))
    weights = np.zeros((n_boot, k))  # how often each block is drawn, / k
    np.add.at(weights, (np.repeat(np.arange(n_boot), k), idx.ravel()), 1.0 / k)
    traj = np.einsum("bk,lkn->lbn", weights, cube)  # (L, B, n): mean of the drawn blocks
    calls = regime_calls(traj.reshape(-1, len(steps)))
    call = calls["call"].reshape(len(layers), n_boot)
    lost = calls["share_lost"].reshape(len(layers), n_boot)
    peak = np.asarray(steps, dtype=float)[calls["peak"]].reshape(len(layers), n_boot)
    any_not_monotone = float((call != MONOTONE).any(axis=0).mean())
    rows = []
    for i, layer in enumerate(layers):
        row = {"metric": metric, "level": TREND_METRICS.get(metric, metric),
               "layer": int(layer), "n_blocks": k, "n_boot": n_boot,
               "share_any_not_monotone": any_not_monotone}
        row.update({f"share_{c.replace(' ', '_')}": float((call[i] == c).mean()) for c in CALLS})
        finite = lost[i][np.isfinite(lost[i])]
        lo, hi = np.percentile(finite, CI) if len(finite) else (np.nan, np.nan)
        row.update(share_lost_low=float(lo), share_lost_high=float(hi))
        plo, phi = np.percentile(peak[i], CI)
        row.update(peak_step_low=float(plo), peak_step_high=float(phi))
        rows.append(row)
    lo, hi = np.percentile(traj, CI, axis=1)  # (L, n) each
    band = pd.DataFrame({"layer": np.repeat(layers, len(steps)),
                         "step": np.tile(np.asarray(steps, dtype=float), len(layers)),
                         "low": lo.ravel(), "high": hi.ravel()})
    return pd.DataFrame(rows), band
