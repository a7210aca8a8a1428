"""qkgeom.analysis.stats on trajectories whose answers are known by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sst

from qkgeom.analysis import collate, stats

from .conftest import make_sweep, monotone_values, write_run, write_sweep


def test_binomial_three_of_four_is_five_sixteenths():
    ct = stats.count_test([0.2, 1.0, 3.0, -0.5], predicted_sign=+1)
    assert (ct["k"], ct["n"]) == (3, 4)
    assert ct["p_value"] == pytest.approx(5 / 16, abs=1e-12)
    assert stats.binomial_p(4, 4) == pytest.approx(1 / 16)
    assert stats.binomial_p(54, 54) == pytest.approx(0.5**54)


def test_count_test_zero_counts_against_and_nan_is_dropped():
    ct = stats.count_test([-1.0, -2.0, 0.0, np.nan], predicted_sign=-1)
    assert (ct["k"], ct["n"]) == (2, 3)
    assert stats.count_test([], 1)["n"] == 0


def test_spearman_monotone_pairs_are_one_and_match_scipy():
    x = np.array([1.0, 2.0, 5.0, 7.0, 11.0])
    rho, _ = stats.spearman(x, np.exp(x))
    assert rho == pytest.approx(1.0)
    rho, _ = stats.spearman(x, -(x**3))
    assert rho == pytest.approx(-1.0)
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 12)), rng.normal(size=(3, 12))
    b[1] = a[1] + 0.3 * b[1]
    rho, p = stats.spearman(a, b)
    for i in range(3):
        ref = sst.spearmanr(a[i], b[i])
        assert rho[i] == pytest.approx(ref.statistic, abs=1e-12)
        assert p[i] == pytest.approx(ref.pvalue, rel=1e-9)


def test_spearman_constant_series_is_nan():
    rho, p = stats.spearman(np.ones(5), np.arange(5.0))
    assert np.isnan(rho) and np.isnan(p)


def test_ols_slope_and_trend_match_linregress():
    steps = np.array([0, 10, 20, 40, 80])
    values = np.array([3.0, 2.0, 4.5, 5.0, 9.0])
    assert stats.ols_slope(steps, values) == pytest.approx(sst.linregress(steps, values).slope)
    tr = stats.trend(steps, values, start_step=15)
    assert tr["start_step"] == 20 and tr["delta"] == pytest.approx(9.0 - 4.5)
    assert tr["slope"] == pytest.approx(sst.linregress(steps[2:], values[2:]).slope)


def test_reference_probe_is_first_probe_at_or_after():
    assert stats.reference_probe([0, 10, 20, 30], 25) == 30
    assert stats.reference_probe([0, 10, 20, 30], 20) == 20
    assert stats.reference_probe([30, 0, 10], 99) == 30  # never probed that late: the last


def test_transient_sign_differs_from_step0_and_from_reference():
    """PR_Q falls sharply until the reference step, then rises: it 'shrinks' from step 0 but
    'expands' from the reference."""
    steps = np.arange(0, 101, 10)
    q = np.where(steps <= 20, 20.0 - 0.75 * steps, 5.0 + 0.125 * (steps - 20))
    assert stats.trend(steps, q, 0)["delta"] == pytest.approx(-5.0)
    assert stats.trend(steps, q, 20)["delta"] == pytest.approx(10.0)
    assert stats.trend(steps, q, 20)["slope"] > 0


def test_window_stats_contrast_share_min_and_time_mean():
    steps = np.array([0, 10, 20, 40])
    q = np.array([5.0, 6.0, 5.0, 7.0])
    k = np.array([5.0, 4.0, 6.0, 4.0])  # contrast 0, +2, -1, +3
    m = {"pr_q": q, "pr_k": k, "pr_qk": k, "attn_entropy": k}
    st = stats.window_stats(steps, m, 0)
    assert st["contrast_pos_share"] == pytest.approx(2 / 3)  # probes after step 0
    assert st["contrast_min_after"] == pytest.approx(-1.0)
    # trapezoid: (0+2)/2*10 + (2-1)/2*10 + (-1+3)/2*20 = 10 + 5 + 20 = 35 over 40 steps
    assert st["contrast_time_mean"] == pytest.approx(35 / 40)
    assert st["contrast_sign"] == 1
    st_ref = stats.window_stats(steps, m, 2)  # from step 20: contrast -1, +3
    assert st_ref["contrast_pos_share"] == pytest.approx(1.0)
    assert st_ref["delta_pr_q"] == pytest.approx(2.0)


def test_verdict_rules():
    assert stats.verdict(12, 12, stats.binomial_p(12, 12)) == "supported"
    assert stats.verdict(10, 12, stats.binomial_p(10, 12)) == "supported"  # 83 %, p = .019
    assert stats.verdict(9, 12, stats.binomial_p(9, 12)) == "mixed"  # 75 %
    assert stats.verdict(6, 12, stats.binomial_p(6, 12)) == "not supported"  # a coin
    assert stats.verdict(4, 4, stats.binomial_p(4, 4)) == "mixed"  # p = 1/16: too few
    assert stats.verdict(53, 54, stats.binomial_p(53, 54), universal=True) == "mixed"
    assert stats.verdict(54, 54, stats.binomial_p(54, 54), universal=True) == "supported"
    assert stats.verdict(0, 0, float("nan")) == "not evaluated"


def test_trajectory_stats_on_synthetic_sweep(tmp_path):
    root = make_sweep(tmp_path / "s", monotone_values(lambda layer: 1 if layer < 3 else -1),
                      inits=("normal",), seeds=(0,))
    table = collate(root)
    traj = stats.trajectory_stats(table)
    # 4 layers x 2 levels x 2 origins
    assert len(traj) == 16
    ref = traj[traj["origin"] == "reference"]
    assert set(ref["start_step"]) == {20} and set(traj["end_step"]) == {100}
    w0 = traj[(traj["level"] == "weight") & (traj["origin"] == "step0")].set_index("layer")
    assert w0.loc[0, "delta_pr_q"] == pytest.approx(5.0)
    assert w0.loc[3, "delta_pr_q"] == pytest.approx(-5.0)
    assert w0.loc[0, "slope_pr_k"] == pytest.approx(-0.05)
    assert np.allclose(w0["rho_k_qk"], 1.0)
    assert np.allclose(w0["rho_qk_entropy"], 1.0)
    assert np.allclose(w0["rho_heads_qk_entropy"], 1.0)
    assert (w0["contrast_pos_share"] == 1.0).all()
    ct = stats.count_test(w0["delta_pr_q"], +1)
    assert (ct["k"], ct["n"]) == (3, 4) and ct["p_value"] == pytest.approx(5 / 16)


def test_per_run_stats_and_seed_average(tmp_path):
    """Two seeds whose PR_Q slopes differ: the seed-averaged trajectory has the mean slope."""
    def shifted(slope):
        base = monotone_values()

        def values(layer, step, metric, head):
            if metric.startswith("pr_q_") or metric.startswith("contrast_"):
                extra = (slope - 0.05) * step
                return base(layer, step, metric, head) + extra
            return base(layer, step, metric, head)
        return values

    root = tmp_path / "seeds"
    write_run(root, "a", 2, "normal", 0, shifted(0.02))
    write_run(root, "b", 2, "normal", 1, shifted(0.06))
    write_sweep(root, [{"run_id": "a"}, {"run_id": "b"}])
    table = collate(root)
    per_run = stats.trajectory_stats(table, by="run", levels=["weight"])
    assert len(per_run) == 2 * 2 * 2  # runs x layers x origins
    slopes = per_run[per_run["origin"] == "step0"].groupby("run_id")["slope_pr_q"].mean()
    assert slopes["a"] == pytest.approx(0.02) and slopes["b"] == pytest.approx(0.06)
    avg = stats.trajectory_stats(table, levels=["weight"])
    assert np.allclose(avg.loc[avg["origin"] == "step0", "slope_pr_q"], 0.04)
    assert set(avg["n_seeds"]) == {2}


def _noisy(noise: np.ndarray, noisy_metric: str, head: int | None = None):
    """``monotone_values`` with ``noise[layer, step // 10]`` added to one metric (of one
    head, or of every head when ``head`` is None)."""
    base = monotone_values()

    def values(layer, step, metric, h):
        v = base(layer, step, metric, h)
        if metric == noisy_metric and (head is None or h == head):
            v += noise[layer, step // 10]
        return v

    return values


def test_bootstrap_is_deterministic_and_brackets_the_mean(tmp_path):
    rng = np.random.default_rng(1)
    noise = {s: rng.normal(scale=0.5, size=(2, 11)) for s in range(4)}
    root = tmp_path / "boot"
    for s in range(4):
        write_run(root, f"r{s}", 2, "normal", s, _noisy(noise[s], "pr_q_weight"),
                  levels=("weight",))
    write_sweep(root, [{"run_id": f"r{s}"} for s in range(4)])
    table = collate(root)
    b1 = stats.bootstrap_ci(table, n_boot=300, levels=["weight"], statistics=["delta_pr_q"])
    b2 = stats.bootstrap_ci(table, n_boot=300, levels=["weight"], statistics=["delta_pr_q"])
    pd.testing.assert_frame_equal(b1, b2)
    row = b1[b1["origin"] == "step0"].iloc[0]
    assert row["ci_low"] < row["mean"] < row["ci_high"]
    assert row["n_trajectories"] == 2
    # A different RNG seed gives a (slightly) different interval.
    b3 = stats.bootstrap_ci(table, n_boot=300, rng_seed=7, levels=["weight"],
                            statistics=["delta_pr_q"])
    assert not np.allclose(b1["ci_low"], b3["ci_low"])


def test_bootstrap_single_seed_has_no_interval(tmp_path):
    root = make_sweep(tmp_path / "one", monotone_values(), inits=("normal",), seeds=(0,))
    b = stats.bootstrap_ci(collate(root), n_boot=50, statistics=["delta_pr_q"])
    assert b["ci_low"].isna().all() and b["mean"].notna().all()


def test_rho_is_the_seed_mean_of_per_run_rho_and_its_interval_brackets_it(tmp_path):
    """Spearman ρ is computed within each run and averaged over seeds, so resampling seeds
    resamples those values: the bootstrap interval is centred on the point estimate."""
    rng = np.random.default_rng(3)
    noise = {s: rng.normal(scale=1.0, size=(2, 11)) for s in range(4)}
    root = tmp_path / "rho"
    for s in range(4):
        write_run(root, f"r{s}", 2, "normal", s, _noisy(noise[s], "pr_qk_weight", head=-1),
                  levels=("weight",))
    write_sweep(root, [{"run_id": f"r{s}"} for s in range(4)])
    table = collate(root)
    traj = stats.trajectory_stats(table, levels=["weight"]).set_index(["origin", "layer"])
    runs = stats.trajectory_stats(table, by="run", levels=["weight"])
    per_run = runs.groupby(["origin", "layer"])["rho_k_qk"].mean()
    assert np.allclose(traj["rho_k_qk"], per_run.reindex(traj.index))
    for layer in (0, 1):  # ρ of the seed-mean trajectory is kept alongside, with its p
        steps = np.arange(0, 101, 10)
        k = 8.0 - 0.05 * steps
        qk = k / 2 + np.mean([noise[s][layer] for s in range(4)], axis=0)
        ref = sst.spearmanr(k, qk)
        assert traj.loc[("step0", layer), "rho_k_qk_of_mean"] == pytest.approx(ref.statistic)
        assert traj.loc[("step0", layer), "p_k_qk"] == pytest.approx(ref.pvalue)
    b = stats.bootstrap_ci(table, n_boot=500, levels=["weight"], statistics=["rho_k_qk"])
    for row in b.itertuples():
        assert row.ci_low <= row.mean <= row.ci_high
