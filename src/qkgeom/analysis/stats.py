"""The statistics every claim is decided by: one test, one interval, one verdict rule.

Each fixed, with its reason, in docs/protocols.md before any experiment; :func:`verdict`
is the rule's only home. Written out rather than ``scipy.stats``:
``ttest_1samp(...).confidence_interval()`` and ``permutation_test`` differ in the last
bits or on ties, and are far slower (docs/speed.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

import numpy as np
from scipy import stats as sst

# The verdict rule (docs/protocols.md explains each number). Written once, used by every claim.
ALPHA = 0.05  # one-sided level of the independent-unit test
SUPPORT_SHARE = 0.80  # the predicted sign in at least this share of units
CI_LEVEL = 0.95
EXACT_MAX_N = 20  # sign-flip: enumerate every pattern up to this many units
FLIP_DRAWS = 200_000  # ... else this many random patterns
FLIP_SEED = 0

POWER = 0.80  # the power a design is sized for, and the detectable effect is quoted at
#: The fewest independent units any verdict but *not evaluated* and *inconclusive* can come
#: from: the smallest exact sign-flip p of n units is 1/2^n, which must fall below α; the
#: same minimum for *equivalent to no effect* (protocol 2), checked on each row's own n.
MIN_UNITS = math.floor(-math.log2(ALPHA)) + 1

SUPPORTED, MIXED, NOT_SUPPORTED, NOT_EVALUATED = ("supported", "mixed", "not supported",
                                                  "not evaluated")
EQUIVALENT, INCONCLUSIVE = "equivalent to no effect", "inconclusive"
#: Every verdict, in the order a summary counts them.
VERDICTS = (SUPPORTED, MIXED, EQUIVALENT, INCONCLUSIVE, NOT_SUPPORTED, NOT_EVALUATED)
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
    """One-sided p of the sign-flip test that the mean of ``values`` has ``predicted_sign``:
    the share of sign patterns whose signed sum is at least the observed one (so p ≥ 2^−n);
    exact up to ``exact_max`` units, else Monte Carlo from a fixed ``seed``. NaN when no
    value is finite."""
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


def tost_p(values: Iterable[float], delta: float) -> float:
    """p of the equivalence test (TOST) that the mean of ``values`` lies within ±``delta``:
    the larger of the two one-sided one-sample t-test p's, as ``scipy.stats.ttest_1samp``
    gives them (tested), written out because the null simulations run it thousands of
    times. NaN for n < 2 or δ not positive."""
    x = finite(values)
    n = len(x)
    if n < 2 or not delta > 0:
        return float("nan")
    mean, sd = float(x.mean()), float(x.std(ddof=1))
    if sd <= 1e-12 * max(1.0, float(np.abs(x).max())):
        return 0.0 if abs(mean) < delta else 1.0  # no spread: the mean is exact
    se = sd / np.sqrt(n)
    lower = sst.t.sf((mean + delta) / se, n - 1)  # H0: mean <= −δ
    upper = sst.t.cdf((mean - delta) / se, n - 1)  # H0: mean >= +δ
    return float(max(lower, upper))


def detectable(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean a one-sided one-sample t-test at ``alpha`` over ``n`` units of
    standard deviation ``sd`` finds with probability ``power`` (noncentral t); NaN when
    undefined."""
    if n < 2 or not (np.isfinite(sd) and sd > 0):
        return float("nan")
    return float(_noncentrality(int(n), float(alpha), float(power)) * sd / np.sqrt(n))


@lru_cache(maxsize=1024)
def _noncentrality(n: int, alpha: float, power: float) -> float:
    """λ with P(T > t_{1−α, n−1}) = ``power`` for T noncentral t(n − 1, λ), by bisection."""
    df, crit = n - 1, _t_quantile(1 - alpha, n - 1)
    lo, hi = 0.0, 1.0
    while sst.nct.sf(crit, df, hi) < power:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sst.nct.sf(crit, df, mid) < power else (lo, mid)
    return hi


def effect_power(sd: float, n: int, effect: float, alpha: float = ALPHA) -> float:
    """Power of the one-sided one-sample t-test at ``alpha`` over ``n`` units of standard
    deviation ``sd`` to find a true mean of ``effect`` (noncentral t; the power
    :func:`detectable` inverts); NaN when undefined."""
    if n < 2 or not (np.isfinite(sd) and sd > 0):
        return float("nan")
    df = n - 1
    return float(sst.nct.sf(_t_quantile(1 - alpha, df), df, effect * np.sqrt(n) / sd))


def equivalence_power(sd: float, n: int, delta: float, alpha: float = ALPHA) -> float:
    """Power of :func:`tost_p` at ``alpha`` to show equivalence within ±``delta`` when the
    true mean is 0 (n units of standard deviation ``sd``), averaged over 2 000 quantiles of
    the sampling distribution of the estimated s."""
    if n < 2 or not (np.isfinite(sd) and sd > 0) or not delta > 0:
        return float("nan")
    df = n - 1
    q = sst.chi2.ppf((np.arange(2000) + 0.5) / 2000, df)
    s = sd * np.sqrt(q / df)
    half = delta - _t_quantile(1 - alpha, df) * s / np.sqrt(n)  # |mean| must stay below it
    z = np.clip(half, 0.0, None) * np.sqrt(n) / sd
    return float(np.mean(2 * sst.norm.cdf(z) - 1))


def seeds_for_power(sd: float, delta: float, alpha: float = ALPHA, power: float = POWER,
                    kind: str = "effect") -> int:
    """The fewest units for which ``kind`` reaches ``power``: ``effect``, the one-sided test
    finds a true mean of ``delta``; ``equivalence``, TOST shows a true mean of 0 within ±δ."""
    if kind not in ("effect", "equivalence"):
        raise ValueError(f"kind must be 'effect' or 'equivalence', got {kind!r}")
    for n in range(2, 10_000):
        if kind == "effect" and detectable(sd, n, alpha, power) <= delta:
            return n
        if kind == "equivalence" and equivalence_power(sd, n, delta, alpha) >= power:
            return n
    raise ValueError("no design under 10 000 units reaches that power")


def unit_test(values: Iterable[float], predicted_sign: int = 1,
              delta: float | None = None) -> dict[str, Any]:
    """Everything the claims tables show for one set of independent unit values: ``n, k,
    share, mean, ci_low, ci_high``, ``p_value`` (sign-flip in the predicted direction),
    ``p_opposite``, ``p_sign`` (sign test), ``sd``, ``detectable`` and, with ``delta``,
    ``p_equiv``. ``predicted_sign = 0``: ``k`` counts values > 0, the p's are two-sided
    and ``p_opposite`` is NaN."""
    v = finite(values)
    mean, lo, hi, n = t_interval(v)
    sd = float(v.std(ddof=1)) if n >= 2 else float("nan")
    p_opp = float("nan")
    if predicted_sign == 0:
        up, down = count_test(v, 1), count_test(v, -1)
        p_flip = min(1.0, 2 * min(sign_flip_p(v, 1), sign_flip_p(v, -1))) if n else np.nan
        p_sign = min(1.0, 2 * min(up["p_value"], down["p_value"])) if n else np.nan
        k = up["k"]
    else:
        ct = count_test(v, predicted_sign)
        k, p_sign, p_flip = ct["k"], ct["p_value"], sign_flip_p(v, predicted_sign)
        p_opp = sign_flip_p(v, -predicted_sign)
    return {"n": n, "k": k, "share": k / n if n else np.nan, "mean": mean, "ci_low": lo,
            "ci_high": hi, "p_value": p_flip, "p_opposite": p_opp, "p_sign": p_sign,
            "sd": sd, "detectable": detectable(sd, n),
            "p_equiv": tost_p(v, delta) if delta else float("nan")}


def holm(p_values: Iterable[float]) -> np.ndarray:
    """Holm's step-down adjusted p's of one family (NaN entries stay NaN and do not count)."""
    p = np.asarray(list(p_values), dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    m = len(ok)
    if m == 0:
        return out
    order = ok[np.argsort(p[ok], kind="stable")]
    adjusted = np.minimum(1.0, np.maximum.accumulate(p[order] * (m - np.arange(m))))
    out[order] = adjusted
    return out


def verdict(k: int, n: int, p_value: float, *, p_opposite: float = float("nan"),
            p_equiv: float = float("nan"), universal_ok: bool | None = None,
            reason: str = "") -> str:
    """The verdict of a claim row from k of n units with the predicted sign and its p's
    (adjusted within the row's family), tried in this order (docs/report.md#verdict-rules):
    *not evaluated* (no unit, or a ``reason``), *equivalent to no effect* (``p_equiv`` < α
    and at least :data:`MIN_UNITS` units), *supported* (``p_value`` < α in ≥ 80 % of units,
    and ``universal_ok`` for a claim about all of them) or else *mixed*, *not supported*
    (``p_opposite`` < α), *inconclusive*."""
    if reason or n == 0:
        return NOT_EVALUATED
    if p_equiv < ALPHA and n >= MIN_UNITS:
        return EQUIVALENT
    if p_value < ALPHA:
        ok = k / n >= SUPPORT_SHARE and universal_ok is not False
        return SUPPORTED if ok else MIXED
    if p_opposite < ALPHA:
        return NOT_SUPPORTED
    return INCONCLUSIVE


def spearman(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Spearman ρ of ``x`` and ``y`` along the last axis (average ranks for ties) and its
    two-sided p (t approximation, as ``scipy.stats.spearmanr``); NaN where undefined."""
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


def spearman_cross(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman ρ of every ``x[i]`` with every ``y[j]`` along the last axis: ``x`` and
    ``y`` (N, …, T) give (N, N, …), entry [i, j] = ρ(x[i], y[j]) (average ranks for ties,
    as :func:`spearman`; NaN where a series is constant or T < 2). The cross-run pairs of
    E2's null (docs/protocols.md#e2) in one product instead of N² calls."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"x and y must have one shape, got {x.shape} and {y.shape}")
    if x.shape[-1] < 2:
        return np.full((x.shape[0], *x.shape[:-1]), np.nan)

    def unit(a: np.ndarray) -> np.ndarray:  # centred ranks of unit length, NaN if constant
        r = sst.rankdata(a, axis=-1)
        r = r - r.mean(-1, keepdims=True)
        norm = np.sqrt((r**2).sum(-1, keepdims=True))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(norm > 0, r / np.where(norm > 0, norm, 1.0), np.nan)

    rho = np.einsum("i...t,j...t->ij...", unit(x), unit(y))
    return np.clip(rho, -1.0, 1.0)
