"""qkgeom.analysis.stats: the tests, the interval and the verdict rule, on values whose
answers are known by hand, and the interval's coverage by simulation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats as sst

from qkgeom.analysis import stats


def _enumerated_p(values: list[float], sign: int = 1) -> float:
    """The sign-flip p by brute force over every pattern (the definition)."""
    v = np.asarray(values, dtype=float) * sign
    sums = [np.dot(s, v) for s in itertools.product((1, -1), repeat=len(v))]
    return float(np.mean(np.asarray(sums) >= v.sum() - 1e-12))


def test_sign_flip_by_hand():
    assert stats.sign_flip_p([1.0, 2.0, 3.0]) == pytest.approx(1 / 8)  # only all-plus
    # ±3 ±1 ±2: sums 6, 4, 2, 0, 0, −2, −4, −6; observed 3 − 1 + 2 = 4 -> 2 of 8
    assert stats.sign_flip_p([3.0, -1.0, 2.0]) == pytest.approx(2 / 8)
    assert stats.sign_flip_p([1.0, 1.0]) == pytest.approx(1 / 4)  # ties count as "at least"
    assert stats.sign_flip_p([0.0, 1.0]) == pytest.approx(2 / 4)  # a zero cannot help
    assert stats.sign_flip_p([-1.0, -2.0, -3.0], predicted_sign=-1) == pytest.approx(1 / 8)
    assert stats.sign_flip_p([-1.0, -2.0, -3.0]) == pytest.approx(1.0)
    assert np.isnan(stats.sign_flip_p([np.nan]))


@pytest.mark.parametrize("n", [1, 4, 7, 12])
def test_sign_flip_meet_in_the_middle_equals_enumeration(n):
    rng = np.random.default_rng(n)
    v = list(rng.normal(0.3, 1.0, size=n))
    assert stats.sign_flip_p(v) == pytest.approx(_enumerated_p(v), abs=1e-15)
    assert stats.sign_flip_p(v, -1) == pytest.approx(_enumerated_p(v, -1), abs=1e-15)


def test_sign_flip_monte_carlo_beyond_twenty_units_is_seeded_and_close_to_exact():
    rng = np.random.default_rng(5)
    v = rng.normal(0.25, 1.0, size=25)
    exact = stats.sign_flip_p(v, exact_max=30)  # 2^13 x 2^12 sums: still cheap
    mc = stats.sign_flip_p(v)
    assert mc == stats.sign_flip_p(v)  # fixed seed: the same p every time
    se = np.sqrt(exact * (1 - exact) / stats.FLIP_DRAWS)
    assert abs(mc - exact) < 4 * se + 1e-5
    assert stats.sign_flip_p(np.full(25, 1.0)) == pytest.approx(1 / (1 + stats.FLIP_DRAWS))


def test_binomial_and_count_test():
    ct = stats.count_test([0.2, 1.0, 3.0, -0.5], predicted_sign=+1)
    assert (ct["k"], ct["n"]) == (3, 4)
    assert ct["p_value"] == pytest.approx(5 / 16, abs=1e-12)
    assert stats.binomial_p(5, 5) == pytest.approx(1 / 32)
    ct = stats.count_test([-1.0, -2.0, 0.0, np.nan], predicted_sign=-1)
    assert (ct["k"], ct["n"]) == (2, 3)  # the zero counts against, the NaN drops out


def test_unit_test_one_and_two_sided():
    u = stats.unit_test([1.0, 2.0, 3.0, 4.0, 5.0], +1)
    assert (u["k"], u["n"]) == (5, 5)
    assert u["p_value"] == pytest.approx(1 / 32) and u["p_sign"] == pytest.approx(1 / 32)
    half = sst.t.ppf(0.975, 4) * np.std([1, 2, 3, 4, 5], ddof=1) / np.sqrt(5)
    assert (u["mean"], u["ci_low"], u["ci_high"]) == pytest.approx((3.0, 3 - half, 3 + half))
    two = stats.unit_test([1.0, 2.0, 3.0, 4.0, 5.0], 0)
    assert two["k"] == 5 and two["p_value"] == pytest.approx(2 / 32)
    assert two["p_sign"] == pytest.approx(2 / 32)
    empty = stats.unit_test([], +1)
    assert empty["n"] == 0 and np.isnan(empty["p_value"]) and np.isnan(empty["mean"])


def test_verdict_rule():
    v = stats.verdict
    assert v(5, 5, 1 / 32) == "supported"
    assert v(4, 5, 0.19) == "inconclusive"  # 80 % but p too large
    assert v(9, 12, 0.01) == "mixed"  # significant, 75 %
    assert v(6, 12, 0.5) == "inconclusive"  # a coin is no evidence either way
    assert v(1, 12, 0.99, p_opposite=0.003) == "not supported"  # the other way, clearly
    assert v(4, 12, 0.7, p_equiv=0.01) == "equivalent to no effect"
    assert v(12, 12, 1e-4, universal_ok=False) == "mixed"  # a layer trajectory disagrees
    assert v(12, 12, 1e-4, universal_ok=True) == "supported"
    assert v(0, 0, float("nan")) == "not evaluated"
    assert v(5, 5, 1 / 32, reason="manipulation check failed") == "not evaluated"


def test_t_interval_by_hand():
    mean, lo, hi, n = stats.t_interval([1.0, 3.0, np.nan])
    half = sst.t.ppf(0.975, 1) * np.sqrt(2.0) / np.sqrt(2)
    assert (mean, lo, hi, n) == pytest.approx((2.0, 2.0 - half, 2.0 + half, 2))
    assert np.isnan(stats.t_interval([4.0])[1])


def _coverage(draw, true_mean: float, n: int, reps: int, rng) -> tuple[float, float]:
    """Coverage of the t-interval and of a percentile bootstrap (500 resamples) of the
    mean, over ``reps`` samples of size n."""
    hits_t = hits_b = 0
    for _ in range(reps):
        x = draw(rng, n)
        _, lo, hi, _ = stats.t_interval(x)
        hits_t += lo <= true_mean <= hi
        boot = x[rng.integers(0, n, size=(500, n))].mean(axis=1)
        blo, bhi = np.percentile(boot, [2.5, 97.5])
        hits_b += blo <= true_mean <= bhi
    return hits_t / reps, hits_b / reps


@pytest.mark.parametrize("name, draw, true_mean", [
    ("normal", lambda rng, n: rng.normal(1.0, 2.0, size=n), 1.0),
    # skewness 0.5 (gamma, shape 16): effects of a few seeds are rarely more skewed than that
    ("gamma16", lambda rng, n: rng.gamma(16.0, size=n), 16.0),
])
def test_t_interval_covers_with_two_to_five_units_where_a_bootstrap_does_not(name, draw,
                                                                             true_mean):
    rng = np.random.default_rng(2024)
    for n in (2, 3, 4, 5):
        cov_t, cov_b = _coverage(draw, true_mean, n, 2000, rng)
        assert cov_t >= 0.93, (name, n, cov_t)
        assert cov_b < 0.93, (name, n, cov_b)  # the interval this replaced


def test_spearman_matches_scipy():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 12)), rng.normal(size=(3, 12))
    b[1] = a[1] + 0.3 * b[1]
    rho, p = stats.spearman(a, b)
    for i in range(3):
        ref = sst.spearmanr(a[i], b[i])
        assert rho[i] == pytest.approx(ref.statistic, abs=1e-12)
        assert p[i] == pytest.approx(ref.pvalue, rel=1e-9)
    rho, p = stats.spearman(np.ones(5), np.arange(5.0))
    assert np.isnan(rho) and np.isnan(p)


def test_tost_by_hand_and_its_edges():
    x = np.array([0.02, -0.01, 0.03, 0.00, 0.01])
    se = x.std(ddof=1) / np.sqrt(5)
    lower = sst.t.sf((x.mean() + 0.1) / se, 4)  # H0: mean <= −δ
    upper = sst.t.cdf((x.mean() - 0.1) / se, 4)  # H0: mean >= δ
    assert stats.tost_p(x, 0.1) == pytest.approx(max(lower, upper), rel=1e-10)
    assert stats.tost_p(x + 0.2, 0.1) > 0.5  # clearly outside ±δ
    assert stats.tost_p([0.05, 0.05, 0.05], 0.1) == 0.0  # no spread, inside
    assert stats.tost_p([0.2, 0.2], 0.1) == 1.0  # no spread, outside
    assert np.isnan(stats.tost_p([0.0], 0.1)) and np.isnan(stats.tost_p(x, 0.0))


def test_holm_by_hand():
    got = stats.holm([0.01, 0.04, 0.03, np.nan, 0.005])
    # sorted 0.005, 0.01, 0.03, 0.04 (m = 4): ×4, ×3, ×2, ×1, then running maximum
    want = [0.03, 0.06, 0.06, np.nan, 0.02]
    np.testing.assert_allclose(got, want, equal_nan=True)
    np.testing.assert_allclose(stats.holm([0.01, 0.9]), [0.02, 0.9])  # the max never lowers
    np.testing.assert_allclose(stats.holm([0.5, 0.9]), [1.0, 1.0])  # capped at 1
    assert np.isnan(stats.holm([np.nan])).all() and len(stats.holm([])) == 0


@pytest.mark.parametrize("n, sd", [(5, 0.1), (20, 0.17)])
def test_power_functions_match_simulation(n: int, sd: float):
    """At the detectable effect a one-sided t-test rejects in 80 % of simulated designs;
    at a true mean of 0 TOST shows equivalence at the stated power (normal approximation,
    within 0.05); seeds_for_power is the smallest n that reaches 0.8."""
    rng = np.random.default_rng(n)
    d = stats.detectable(sd, n)
    x = rng.normal(d, sd, size=(20_000, n))
    t = x.mean(1) / (x.std(1, ddof=1) / np.sqrt(n))
    assert (t > sst.t.ppf(0.95, n - 1)).mean() == pytest.approx(0.80, abs=0.01)
    z = rng.normal(0.0, sd, size=(4_000, n))
    hits = np.mean([stats.tost_p(row, 0.1) < 0.05 for row in z])
    assert hits == pytest.approx(stats.equivalence_power(sd, n, 0.1), abs=0.05)
    need = stats.seeds_for_power(sd, 0.1)
    assert stats.detectable(sd, need) <= 0.1 < stats.detectable(sd, need - 1)
    # effect_power is detectable's inverse, and the simulated power at another effect
    assert stats.effect_power(sd, n, d) == pytest.approx(0.80, abs=1e-6)
    y = rng.normal(d / 2, sd, size=(20_000, n))
    sim = (y.mean(1) / (y.std(1, ddof=1) / np.sqrt(n)) > sst.t.ppf(0.95, n - 1)).mean()
    assert sim == pytest.approx(stats.effect_power(sd, n, d / 2), abs=0.01)
