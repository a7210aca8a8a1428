"""The regime call of a layer's contrast trajectory: did it rise, did it fall, beyond noise.

On the checkpoints after the LR warm-up, the gain to the peak and the drop from it to the
last checkpoint are each studentized and compared with surrogates of a *constant* curve
plus the measured noise (token blocks and checkpoint jitter), the peak taken in every
surrogate as in the data: a constant curve gives the largest drop any monotone curve can
give with the same noise. Over seeds the noise also holds a random walk within each run,
its step variance estimated across the seeds (:func:`drift_variance`). The rule, each
choice and the rules it replaced: docs/protocols.md#the-regime-call. The surrogates are
drawn once per call from a fixed seed and shared by every row; the work is vectorised over
rows in chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
from scipy import stats as sst

from qkgeom.analysis.stats import ALPHA

__all__ = ["CALLS", "DRIFT_MIN_SEEDS", "FALL", "MIN_POINTS", "MONOTONE", "NO_TREND",
           "N_SURROGATES", "RISE_FALL", "Regime", "block_weights", "call_of", "drift_variance",
           "peak_stats", "regime_calls", "roughness", "studentize", "token_deviations",
           "upper_p"]

RISE_FALL, MONOTONE, FALL, NO_TREND = "rise then fall", "monotone rise", "fall", "no trend"
CALLS = (RISE_FALL, MONOTONE, FALL, NO_TREND)
#: Fewest checkpoints a call is made on: the noise estimate needs two second differences.
MIN_POINTS = 4
N_SURROGATES = 1999
SURROGATE_SEED = 0
_MEDIAN_CHI2_1 = float(sst.chi2.ppf(0.5, 1))  # median of a squared standard normal
_CHUNK = 4_000_000  # elements of one (rows, surrogates, checkpoints) block
#: Fewest seeds the random walk's step variance is estimated from (below: no walk).
DRIFT_MIN_SEEDS = 3


def roughness(x: np.ndarray) -> np.ndarray:
    """The noise variance of each row of ``x`` (rows, n) from its second differences:
    median over interior points of ((x_{i−1} − 2x_i + x_{i+1})/√6)² divided by the median
    of χ²₁. Unbiased for independent normal noise around a locally linear trend; the median
    keeps a peak or a knee (a few points of large curvature) from inflating it. NaN for
    n < 3."""
    x = np.asarray(x, dtype=float)
    if x.shape[-1] < 3:
        return np.full(x.shape[:-1], np.nan)
    d = (x[..., :-2] - 2 * x[..., 1:-1] + x[..., 2:]) ** 2 / 6.0
    return np.median(d, axis=-1) / _MEDIAN_CHI2_1


def token_deviations(blocks: np.ndarray | None, rows: int, n: int) -> np.ndarray:
    """``blocks`` (rows, K, n) → the deviations of each block from the blocks' mean, scaled
    by √(K/(K−1)) so that the mean of K blocks drawn with replacement has the variance of
    a mean of K blocks; zeros (rows, 0, n) without blocks. A row with a non-finite block
    value gets no token noise (its jitter then carries all of it)."""
    if blocks is None or blocks.ndim != 3 or blocks.shape[1] < 2:
        return np.zeros((rows, 0, n))
    b = np.asarray(blocks, dtype=float)
    k = b.shape[1]
    dev = (b - b.mean(axis=1, keepdims=True)) * np.sqrt(k / (k - 1))
    return np.where(np.isfinite(dev).all(axis=(1, 2))[:, None, None], dev, 0.0)


def studentize(stat: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``stat`` / √``v`` (the noise sd from :func:`roughness`); where the series has no
    noise at all (v = 0), a positive statistic is infinitely significant (+inf) and no
    gain or drop is 0."""
    stat = np.asarray(stat, dtype=float)
    v = np.broadcast_to(np.asarray(v, dtype=float), stat.shape)
    pos = np.isfinite(v) & (v > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = stat / np.sqrt(np.where(pos, v, 1.0))
    return np.where(pos, out, np.where(stat > 0, np.inf, np.where(np.isnan(stat), np.nan,
                                                                   0.0)))


def drift_variance(x: np.ndarray, dev: np.ndarray | None = None) -> float:
    """The step variance q of a random walk within each run, from one layer's series over
    seeds: ``x`` (S seeds, n checkpoints, on the same steps), ``dev`` (S, K, n) the seeds'
    token deviations (:func:`token_deviations`) or None. The residuals from the seeds' mean
    carry no curve the seeds share (a regime included); their robust semi-variogram at
    lags h = 1 … ⌊(n − 1)/2⌋ checkpoints (median of ½·Δ_h² over seeds and checkpoints,
    divided by the median of χ²₁, times S/(S − 1)), less the token noise's own (mean over
    blocks, median over seeds and checkpoints), is τ² + (h/2)·q under independent jitter
    plus a walk: q = 2 × its least-squares slope on h, never below 0. 0 with fewer than
    :data:`DRIFT_MIN_SEEDS` seeds, fewer than 3 lags or a non-finite value."""
    x = np.asarray(x, dtype=float)
    s, n = x.shape
    lags = np.arange(1, (n - 1) // 2 + 1)
    if s < DRIFT_MIN_SEEDS or len(lags) < 3 or not np.isfinite(x).all():
        return 0.0
    r = x - x.mean(axis=0)
    k = 0 if dev is None or dev.ndim != 3 else dev.shape[1]
    gamma = np.empty(len(lags))
    for i, h in enumerate(lags):
        g = np.median((r[:, h:] - r[:, :-h]) ** 2 / 2.0) / _MEDIAN_CHI2_1 * s / (s - 1)
        if k:
            g -= np.median(((dev[..., h:] - dev[..., :-h]) ** 2 / 2.0).mean(axis=1)) / k
        gamma[i] = g
    slope = np.polyfit(lags.astype(float), gamma, 1)[0]
    return float(max(0.0, 2.0 * slope)) if np.isfinite(slope) else 0.0


def peak_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(peak index, gain, drop)`` along the last axis: the first largest value, its
    excess over the first and over the last value."""
    peak = np.argmax(x, axis=-1)
    top = np.take_along_axis(x, peak[..., None], axis=-1)[..., 0]
    return peak, top - x[..., 0], top - x[..., -1]


@dataclass(frozen=True)
class Regime:
    """What :func:`regime_calls` returns, one entry per row (arrays of length rows), and
    the sorted null distributions (rows, surrogates) for the token-block bootstrap."""

    peak: np.ndarray
    gain: np.ndarray
    drop: np.ndarray
    p_rise: np.ndarray
    p_fall: np.ndarray
    z_rise: np.ndarray
    z_fall: np.ndarray
    call: np.ndarray
    share_lost: np.ndarray
    token_sd: np.ndarray  # the token noise of one checkpoint (root mean square over them)
    jitter_sd: np.ndarray  # τ
    drift_sd: np.ndarray  # √q: the sd of one step of the random walk (0: none)
    null_gain: np.ndarray
    null_drop: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        """Every per-row array (not the null distributions), by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if not f.name.startswith("null_")}

    def row(self, i: int) -> dict:
        """Row ``i`` as a dict of scalars."""
        return {k: v[i] for k, v in self.arrays().items()}


def upper_p(null_sorted: np.ndarray, observed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(p, mid-p)`` of each ``observed`` (rows, m) against its row's sorted null (rows, S):
    p = (1 + #{null ≥ obs})/(1 + S); mid-p counts ties half, (#{null > obs} +
    ½#{null = obs} + ½)/(1 + S)."""
    s = null_sorted.shape[1]
    obs = np.atleast_2d(observed)
    ge = np.empty(obs.shape)
    gt = np.empty(obs.shape)
    for r in range(len(obs)):
        ge[r] = s - np.searchsorted(null_sorted[r], obs[r], side="left")
        gt[r] = s - np.searchsorted(null_sorted[r], obs[r], side="right")
    return (1 + ge) / (1 + s), (gt + 0.5 * (ge - gt) + 0.5) / (1 + s)


def call_of(p_rise: np.ndarray, p_fall: np.ndarray, gain: np.ndarray, drop: np.ndarray,
            alpha: float = ALPHA) -> tuple[np.ndarray, np.ndarray]:
    """``(call, share of the gain lost)`` from the two p's (NaN: no call) and the gain and
    drop; the share only where the rise is significant."""
    rise, fall = p_rise < alpha, p_fall < alpha
    call = np.where(rise & fall, RISE_FALL, np.where(rise, MONOTONE,
                                                     np.where(fall, FALL, NO_TREND)))
    with np.errstate(invalid="ignore", divide="ignore"):
        lost = np.where(rise & (gain > 0), drop / np.where(gain > 0, gain, 1.0), np.nan)
    return call, lost


def block_weights(rng: np.random.Generator, draws: int, k: int) -> np.ndarray:
    """(draws, k): in each draw of k blocks with replacement, the share that fell on each
    block (the surrogates' token noise and the bootstrap's resamples)."""
    weights = np.zeros((draws, k))
    if k:
        idx = rng.integers(0, k, size=(draws, k))
        np.add.at(weights, (np.repeat(np.arange(draws), k), idx.ravel()), 1.0 / k)
    return weights


def regime_calls(x: np.ndarray, blocks: np.ndarray | None = None, alpha: float = ALPHA, *,
                 n_surrogates: int = N_SURROGATES, seed: int = SURROGATE_SEED,
                 drift: np.ndarray | float | None = None) -> Regime:
    """The regime call of every row of ``x`` (rows, n checkpoints after the warm-up, in step
    order), with ``blocks`` (rows, K, n) the same contrast measured on each token block (or
    None: jitter only) and ``drift`` the step variance q of a random walk per row
    (:func:`drift_variance`; None or 0: no walk), capped at 3 × the row's roughness beyond
    its token noise, whose part q/3 of it the walk then takes from the jitter. Rows with
    fewer than :data:`MIN_POINTS` checkpoints or a non-finite value get NaN p's and *no
    trend*. See the module docstring."""
    x = np.atleast_2d(np.asarray(x, dtype=float))
    rows, n = x.shape
    dev = token_deviations(blocks, rows, n)
    k = dev.shape[1]
    ok = np.isfinite(x).all(axis=1) & (n >= MIN_POINTS)
    peak, gain, drop = peak_stats(np.where(np.isfinite(x), x, -np.inf)) if n else (
        np.zeros(rows, dtype=int), np.full(rows, np.nan), np.full(rows, np.nan))
    gain = np.where(ok, gain, np.nan)
    drop = np.where(ok, drop, np.nan)
    if k:  # the token noise's own second-difference variance, per checkpoint, then median
        d2 = (dev[..., :-2] - 2 * dev[..., 1:-1] + dev[..., 2:]) ** 2 / 6.0 if n >= 3 \
            else np.full((rows, k, 1), np.nan)
        v_token = np.median(d2.mean(axis=1) / k, axis=-1)
        token_sd = np.sqrt((dev ** 2).mean(axis=(1, 2)) / k)
    else:
        v_token, token_sd = np.zeros(rows), np.zeros(rows)
    with np.errstate(invalid="ignore"):
        beyond = np.maximum(0.0, roughness(x) - v_token)  # τ² + q/3
    q = np.zeros(rows) if drift is None else np.broadcast_to(
        np.nan_to_num(np.asarray(drift, dtype=float)), (rows,))
    q = np.where(np.isfinite(beyond), np.clip(q, 0.0, 3.0 * np.nan_to_num(beyond)), 0.0)
    jitter = np.where(ok, np.sqrt(np.maximum(0.0, beyond - q / 3.0)), np.nan)
    walk_sd = np.where(ok, np.sqrt(q), np.nan)
    null_gain = np.full((rows, n_surrogates), np.nan)
    null_drop = np.full((rows, n_surrogates), np.nan)
    p_rise, p_fall, z_rise, z_fall = (np.full(rows, np.nan) for _ in range(4))
    todo = np.flatnonzero(ok)
    if len(todo):
        rng = np.random.default_rng(seed)  # the jitter's normals, then the blocks' draws
        normals = rng.standard_normal((n_surrogates, n))
        weights = block_weights(rng, n_surrogates, k)
        walk = np.cumsum(rng.standard_normal((n_surrogates, n)), axis=1) if (
            q[todo] > 0).any() else None  # drawn last: without a walk, the draws of before
        step = max(1, _CHUNK // (n_surrogates * n))
        for a in range(0, len(todo), step):
            idx = todo[a:a + step]
            eps = jitter[idx, None, None] * normals[None]  # (r, S, n)
            if walk is not None:
                eps = eps + walk_sd[idx, None, None] * walk[None]
            if k:
                eps = eps + np.einsum("sk,rkn->rsn", weights, dev[idx])
            _, g, d = peak_stats(eps)
            v = roughness(eps)
            null_gain[idx] = np.sort(studentize(g, v), axis=1)
            null_drop[idx] = np.sort(studentize(d, v), axis=1)
        v = roughness(x[todo])
        pr, mr = upper_p(null_gain[todo], studentize(gain[todo], v)[:, None])
        pf, mf = upper_p(null_drop[todo], studentize(drop[todo], v)[:, None])
        p_rise[todo], p_fall[todo] = pr[:, 0], pf[:, 0]
        z_rise[todo], z_fall[todo] = sst.norm.isf(mr[:, 0]), sst.norm.isf(mf[:, 0])
    call, lost = call_of(p_rise, p_fall, gain, drop, alpha)
    return Regime(peak=peak, gain=gain, drop=drop, p_rise=p_rise, p_fall=p_fall,
                  z_rise=z_rise, z_fall=z_fall, call=call, share_lost=lost,
                  token_sd=np.where(ok, token_sd, np.nan), jitter_sd=jitter,
                  drift_sd=walk_sd, null_gain=null_gain, null_drop=null_drop)
