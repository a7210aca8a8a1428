"""The token-block bootstrap of the E4 regime calls (descriptive; docs/protocols.md).

One resample draws the K token blocks with replacement and moves the all-token trajectory
by the mean of the drawn blocks' deviations, so resamples centre on the number every table
reports; the calls are recomputed on each against the layer's own null. Written out:
``scipy.stats.bootstrap`` resamples observations of a numeric statistic, not blocks of a
trajectory whose categorical call is recomputed.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis.e4.regime import (
    CALLS,
    FALL,
    RISE_FALL,
    block_weights,
    call_of,
    peak_stats,
    regime_calls,
    roughness,
    studentize,
    token_deviations,
    upper_p,
)
from qkgeom.analysis.e4.trends import PRIMARY, TREND_METRICS, Drift, trajectories

__all__ = ["BOOT_SEED", "CI", "N_BOOT", "block_bootstrap"]

N_BOOT = 2000
BOOT_SEED = 0
CI = (2.5, 97.5)


def block_bootstrap(metrics: pd.DataFrame, blocks: pd.DataFrame, warmup: int | None = None,
                    metric: str = PRIMARY, n_boot: int = N_BOOT, seed: int = BOOT_SEED,
                    drift: Drift | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(per layer, band)`` of the block bootstrap of ``metric``: ``metrics`` the
    all-token rows (``block`` −1), ``blocks`` the per-block rows, ``warmup`` the step the
    LR warm-up ends (None: unknown, every checkpoint in the rule). Per layer: ``metric,
    level, layer, n_blocks, n_boot``, the share of resamples per call (``share_<call>``),
    ``share_lost_low/high`` and ``peak_step_low/high`` (percentile intervals; the share
    lost over the resamples with a significant rise), and ``share_any_fall`` (the same on
    every row: the share of resamples in which at least one layer falls significantly;
    one resample draws the same blocks for every layer). Band: ``layer, step, low, high``
    per checkpoint; ``drift``: the random walk of the layers' null (a set's; None: none).
    Empty frames without blocks."""
    tr = trajectories(metrics, blocks, metric, warmup)
    if tr is None or tr.blocks is None or tr.blocks.shape[1] < 2:
        return pd.DataFrame(), pd.DataFrame()
    ok = np.isfinite(tr.x).all(axis=1) & np.isfinite(tr.blocks).all(axis=(1, 2))
    if not ok.any():
        return pd.DataFrame(), pd.DataFrame()
    layers = [la for la, good in zip(tr.layers, ok, strict=True) if good]
    x, cube = tr.x[ok], tr.blocks[ok]
    k = cube.shape[1]
    dev = token_deviations(cube, len(layers), len(tr.steps))
    traj = x[:, None, :] + np.einsum("bk,lkn->lbn", block_weights(np.random.default_rng(seed), n_boot, k), dev)
    win = traj[..., tr.window]  # (L, B, n in the rule)
    q = None if drift is None else np.array([drift.get((metric, int(la)), 0.0)
                                             for la in layers])
    null = regime_calls(x[:, tr.window], cube[..., tr.window], drift=q)
    peak, gain, drop = peak_stats(win)
    v = roughness(win)
    p_rise = upper_p(null.null_gain, studentize(gain, v))[0]
    p_fall = upper_p(null.null_drop, studentize(drop, v))[0]
    call, lost = call_of(p_rise, p_fall, gain, drop)
    bad = ~np.isfinite(null.p_rise)  # too few checkpoints: no call in any resample
    call[bad] = "n/a"
    steps_in = tr.steps[tr.window]
    any_fall = float(np.isin(call, (RISE_FALL, FALL)).any(axis=0).mean())
    rows = []
    for i, layer in enumerate(layers):
        row = {"metric": metric, "level": TREND_METRICS.get(metric, metric),
               "layer": int(layer), "n_blocks": k, "n_boot": n_boot,
               "share_any_fall": any_fall}
        row.update({f"share_{c.replace(' ', '_')}": float((call[i] == c).mean())
                    for c in CALLS})
        finite = lost[i][np.isfinite(lost[i])]
        lo, hi = np.percentile(finite, CI) if len(finite) else (np.nan, np.nan)
        row.update(share_lost_low=float(lo), share_lost_high=float(hi))
        plo, phi = np.percentile(steps_in[peak[i]], CI) if len(steps_in) else (np.nan,) * 2
        row.update(peak_step_low=float(plo), peak_step_high=float(phi))
        rows.append(row)
    lo, hi = np.percentile(traj, CI, axis=1)  # (L, n) each
    band = pd.DataFrame({"layer": np.repeat(layers, len(tr.steps)),
                         "step": np.tile(tr.steps, len(layers)),
                         "low": lo.ravel(), "high": hi.ravel()})
    return pd.DataFrame(rows), band
