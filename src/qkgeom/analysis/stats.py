"""The statistics every claim is decided by: one test, one interval, one verdict rule.

Fixed in docs/protocols.md before any experiment; every experiment's claims call these and
nothing else:

- :func:`t_interval`: two-sided 95 % t-interval of the mean over *independent units* (runs,
  seeds). A percentile bootstrap of a handful of seeds under-covers badly (about 52 % with
  2 seeds, 79 % with 4; a simulation test keeps the t-interval at ≥ 93 %).
- :func:`sign_flip_p`: the exact sign-flip (permutation) test of the mean, one-sided in the
  predicted direction: under H0 each unit's value is symmetric about 0, so every pattern of
  signs is equally likely. All 2^n patterns are enumerated for n ≤ 20 (meet in the middle:
  two halves of 2^(n/2) sums), else 200 000 random patterns with a fixed seed and
  p = (1 + count)/(1 + draws). This is the verdict's p.
- :func:`binomial_p` / :func:`count_test`: the exact sign test (binomial, p = ½), shown
  beside it; a zero counts against the claim.
- :func:`unit_test`: both tests, the count and the interval for one set of unit values.
- :func:`verdict`: the one place the verdict rule lives.
- :func:`spearman`: Spearman ρ along the last axis (vectorised).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any

import numpy as np
from scipy import stats as sst

# The verdict rule (docs/protocols.md explains each number). Written once, used by every claim.
ALPHA = 0.05  # one-sided level of the independent-unit test
SUPPORT_SHARE = 0.80  # the predicted sign in at least this share of units ...
FAIL_SHARE = 0.50  # ... not supported at or below this share (no better than a coin)
CI_LEVEL = 0.95
EXACT_MAX_N = 20  # sign-flip: enumerate every pattern up to this many units
FLIP_DRAWS = 200_000  # ... else this many random patterns
FLIP_SEED = 0

SUPPORTED, MIXED, NOT_SUPPORTED, NOT_EVALUATED = ("supported", "mixed", "not supported",
                                                  "not evaluated")
TEST_FLIP = "exact sign-flip test of the mean (one-sided)"


def finite(values: Iterable[float]) -> np.ndarray:
    """The finite entries of ``values`` as a float array (NaN = a unit that could not be
    measured; it drops out of n)."""
    v = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=float)
    return v[np.isfinite(v)]


def t_interval(values: Iterable[float], level: float = CI_LEVEL) -> tuple[float, float, float, int]:
    """``(mean, low, high, n)``: the two-sided t-interval of the mean of the finite values
    (n − 1 degrees of freedom); NaN bounds when n < 2."""
    x = finite(values)
    n = len(x)
    if n == 0:
        return np.nan, np.nan, np.nan, 0
    mean = float(x.mean())
    if n < 2:
        return mean, np.nan, np.nan, n
    half = _t_quantile(0.5 + level / 2, n - 1) * float(x.std(ddof=1)) / np.sqrt(n)
    return mean, mean - half, mean + half, n


@lru_cache(maxsize=512)
def _t_quantile(q: float, df: int) -> float:
    return float(sst.t.ppf(q, df))


def _signed_sums(v: np.ndarray) -> np.ndarray:
    """All 2^len(v) sums Σ ±v_i."""
    sums = np.zeros(1)
    for x in v:
        sums = np.concatenate([sums + x, sums - x])
    return sums


def sign_flip_p(values: Iterable[float], predicted_sign: int = 1, *,
                exact_max: int = EXACT_MAX_N, draws: int = FLIP_DRAWS,
                seed: int = FLIP_SEED) -> float:
    """One-sided p of the sign-flip test that the mean of ``values`` has ``predicted_sign``.

    p = the share of sign patterns whose signed sum is at least the observed one (the
    observed pattern included, so p ≥ 2^−n). Exact for n ≤ ``exact_max``; beyond, Monte
    Carlo with ``draws`` patterns from a fixed ``seed``. NaN when no value is finite."""
    if predicted_sign not in (1, -1):
        raise ValueError("predicted_sign must be +1 or -1")
    v = finite(values) * predicted_sign
    n = len(v)
    if n == 0:
        return float("nan")
    observed = float(v.sum())
    tol = 1e-12 * max(float(np.abs(v).sum()), 1e-300)  # summation order, not a real excess
    if n <= exact_max:
        half = n // 2
        a = _signed_sums(v[:half])
        b = np.sort(_signed_sums(v[half:]))
        at_least = len(b) - np.searchsorted(b, observed - tol - a, side="left")
        return float(at_least.sum() / 2.0**n)
    rng = np.random.default_rng(seed)
    count, left = 0, draws
    while left:
        m = min(left, 20_000)
        signs = rng.integers(0, 2, size=(m, n), dtype=np.int8) * 2 - 1
        count += int((signs @ v >= observed - tol).sum())
        left -= m
    return (1 + count) / (1 + draws)


@lru_cache(maxsize=4096)
def binomial_p(k: int, n: int) -> float:
    """Exact one-sided binomial (sign-test) p of ≥ k successes in n under p = ½."""
    if n <= 0:
        return float("nan")
    return float(sst.binomtest(int(k), int(n), 0.5, alternative="greater").pvalue)


def count_test(values: Iterable[float], predicted_sign: int = 1) -> dict[str, float]:
    """How many finite ``values`` have the predicted sign (strictly: a zero counts against)
    and the exact one-sided sign-test p. Keys ``k, n, share, p_value``."""
    if predicted_sign not in (1, -1):
        raise ValueError("predicted_sign must be +1 or -1")
    v = finite(values)
    k = int((np.sign(v) == predicted_sign).sum())
    n = len(v)
    return {"k": k, "n": n, "share": k / n if n else float("nan"), "p_value": binomial_p(k, n)}


def unit_test(values: Iterable[float], predicted_sign: int = 1) -> dict[str, Any]:
    """Everything the claims tables show for one set of independent unit values.

    ``n, k, share, mean, ci_low, ci_high, p_value`` (sign-flip, the verdict's p),
    ``p_sign`` (exact sign test). ``predicted_sign = 0`` (no prediction): ``k`` counts
    values > 0 and both p-values are two-sided (twice the smaller one-sided p, at most 1).
    """
    v = finite(values)
    mean, lo, hi, n = t_interval(v)
    if predicted_sign == 0:
        up, down = count_test(v, 1), count_test(v, -1)
        p_flip = min(1.0, 2 * min(sign_flip_p(v, 1), sign_flip_p(v, -1))) if n else np.nan
        p_sign = min(1.0, 2 * min(up["p_value"], down["p_value"])) if n else np.nan
        k = up["k"]
    else:
        ct = count_test(v, predicted_sign)
        k, p_sign, p_flip = ct["k"], ct["p_value"], sign_flip_p(v, predicted_sign)
    return {"n": n, "k": k, "share": k / n if n else np.nan, "mean": mean, "ci_low": lo,
            "ci_high": hi, "p_value": p_flip, "p_sign": p_sign}


def verdict(k: int, n: int, p_value: float, *, universal_ok: bool | None = None,
            reason: str = "") -> str:
    """The verdict of a claim from k of n independent units with the predicted sign and the
    one-sided p of the independent-unit test.

    - ``not evaluated``: no unit (n = 0), or a ``reason`` (e.g. a failed manipulation check);
    - ``not supported``: the predicted sign in ≤ 50 % of units (no better than a coin);
    - ``supported``: ≥ 80 % and p < 0.05, and for a universal claim ("in all …")
      ``universal_ok`` (every descriptive unit has the sign);
    - ``mixed``: anything in between, including a clear majority in too few units.
    """
    if reason or n == 0:
        return NOT_EVALUATED
    share = k / n
    if share <= FAIL_SHARE:
        return NOT_SUPPORTED
    if share >= SUPPORT_SHARE and p_value < ALPHA and universal_ok is not False:
        return SUPPORTED
    return MIXED


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


def nanmean(x: np.ndarray, axis: int) -> np.ndarray:
    """Mean over ``axis`` of the finite entries (NaN where there is none), without warnings."""
    ok = np.isfinite(x)
    n = ok.sum(axis=axis)
    s = np.where(ok, x, 0.0).sum(axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, s / np.maximum(n, 1), np.nan)
