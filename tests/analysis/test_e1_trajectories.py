"""qkgeom.analysis.e1.trajectories: per-layer and per-run statistics known by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sst

from qkgeom.analysis import collate, stats
from qkgeom.analysis.e1 import trajectories as tj
from qkgeom.config import TrainConfig

from .conftest import make_sweep, monotone_values, write_run, write_sweep


def test_ols_slope_and_trend_match_linregress():
    steps = np.array([0, 10, 20, 40, 80])
    values = np.array([3.0, 2.0, 4.5, 5.0, 9.0])
    assert tj.ols_slope(steps, values) == pytest.approx(sst.linregress(steps, values).slope)
    tr = tj.trend(steps, values, start_step=15)
    assert tr["start_step"] == 20 and tr["delta"] == pytest.approx(9.0 - 4.5)
    assert tr["slope"] == pytest.approx(sst.linregress(steps[2:], values[2:]).slope)


def test_reference_probe_is_first_probe_at_or_after():
    assert tj.reference_probe([0, 10, 20, 30], 25) == 30
    assert tj.reference_probe([0, 10, 20, 30], 20) == 20
    assert tj.reference_probe([30, 0, 10], 99) == 30  # never probed that late: the last


def test_default_reference_is_a_quarter_of_the_run_and_an_explicit_one_wins():
    assert TrainConfig(steps=300, warmup_steps=30).ref_step == 75
    assert TrainConfig(steps=2000).ref_step == 500
    assert TrainConfig.ref_step_of(41) == 11  # rounded up: no probe before 25 % counts
    assert TrainConfig(steps=300, reference_step=40).ref_step == 40
    assert TrainConfig(steps=300, reference_step=0).ref_step == 0


def test_window_stats_four_contrast_readings():
    steps = np.array([0, 10, 20, 40])
    q = np.array([5.0, 6.0, 5.0, 7.0])
    k = np.array([5.0, 4.0, 6.0, 4.0])  # contrast 0, +2, -1, +3
    m = {"pr_q": q, "pr_k": k, "pr_qk": k, "attn_entropy": k}
    st = tj.window_stats(steps, m, 0)
    assert st["contrast_min_after"] == pytest.approx(-1.0)  # (a) not positive at every probe
    assert st["contrast_end"] == pytest.approx(3.0)  # (b)
    # (c) trapezoid: (0+2)/2*10 + (2-1)/2*10 + (-1+3)/2*20 = 35 over 40 steps
    assert st["contrast_time_mean"] == pytest.approx(35 / 40)
    assert st["delta_contrast"] == pytest.approx(3.0 - 0.0)  # (d) ΔPR_Q − ΔPR_K = 2 − (−1)
    assert st["contrast_pos_share"] == pytest.approx(2 / 3)  # probes after step 0
    st_ref = tj.window_stats(steps, m, 2)  # from step 20: contrast -1, +3
    assert st_ref["contrast_min_after"] == pytest.approx(3.0)
    assert st_ref["delta_pr_q"] == pytest.approx(2.0)
    assert st_ref["delta_contrast"] == pytest.approx(4.0)


def test_layer_statistics_on_a_synthetic_sweep(tmp_path):
    root = make_sweep(tmp_path / "s", monotone_values(lambda layer: 1 if layer < 3 else -1,
                                                      wiggle=0.3),
                      inits=("normal",), seeds=(0,))
    table = collate(root)
    runs, traj = tj.layer_statistics(table)
    assert len(traj) == 4 * 2 * 2 and len(runs) == 4 * 2 * 2  # layers x levels x origins
    ref = traj[traj["origin"] == "reference"]
    assert set(ref["start_step"]) == {30}  # 25 % of 100 steps -> first probe at or after 25
    w0 = traj[(traj["level"] == "weight") & (traj["origin"] == "step0")].set_index("layer")
    assert w0.loc[0, "delta_pr_q"] == pytest.approx(5.0)
    assert w0.loc[3, "delta_pr_q"] == pytest.approx(-5.0)
    steps = np.arange(0, 101, 10)
    k = 8.0 - 0.05 * steps + 0.3 * np.sin(steps)
    assert w0.loc[0, "slope_pr_k"] == pytest.approx(np.polyfit(steps, k, 1)[0])
    # pr_qk = PR_K / 2 and the entropy follows pr_qk: their changes move together
    assert np.allclose(w0[["rho_k_qk", "rho_qk_entropy", "rho_heads_qk_entropy"]], 1.0)
    assert np.allclose(w0[["rho_k_qk_levels", "rho_qk_entropy_levels"]], 1.0)
    one = tj.run_stats(runs)
    row = one[(one["level"] == "weight") & (one["origin"] == "step0")].iloc[0]
    assert row["delta_pr_q"] == pytest.approx((5 + 5 + 5 - 5) / 4)  # mean over the 4 layers
    assert row["n_layers"] == 4 and row["n_heads"] == 3


def test_per_run_values_their_seed_mean_and_cells(tmp_path):
    """Two seeds whose PR_Q slopes differ: each run has its own slope, the trajectory the
    mean, the cell the mean of the runs' whole-model values."""
    def shifted(slope):
        base = monotone_values()

        def values(layer, step, metric, head):
            if metric.startswith(("pr_q_", "contrast_")):
                return base(layer, step, metric, head) + (slope - 0.05) * step
            return base(layer, step, metric, head)
        return values

    root = tmp_path / "seeds"
    write_run(root, "a", 2, "normal", 0, shifted(0.02))
    write_run(root, "b", 2, "normal", 1, shifted(0.06))
    write_sweep(root, [{"run_id": "a"}, {"run_id": "b"}])
    per_layer, traj = tj.layer_statistics(collate(root), levels=["weight"])
    runs = tj.run_stats(per_layer)
    s0 = runs[runs["origin"] == "step0"].set_index("run_id")
    assert s0.loc["a", "slope_pr_q"] == pytest.approx(0.02)
    assert s0.loc["b", "slope_pr_q"] == pytest.approx(0.06)
    assert np.allclose(traj.loc[traj["origin"] == "step0", "slope_pr_q"], 0.04)
    assert set(traj["n_seeds"]) == {2}
    cells = tj.cell_stats(runs)
    c0 = cells[cells["origin"] == "step0"].iloc[0]
    assert c0["slope_pr_q"] == pytest.approx(0.04) and c0["n_runs"] == 2


def test_changes_of_two_co_trending_series_do_not_correlate(tmp_path):
    """PR_K falls steadily and pr_qk rises steadily, each with its own independent noise:
    their levels correlate (ρ of the levels ≈ −1: two trends), their probe-to-probe changes
    do not, which is what E2.1 reads."""
    rng = np.random.default_rng(5)
    base = monotone_values()
    root = tmp_path / "trend"
    for s in range(6):
        nk, nq = rng.normal(scale=0.05, size=(2, 2, 11))

        def values(layer, step, metric, h, nk=nk, nq=nq):
            if metric == "pr_k_weight" and h == -1:
                return 8.0 - 0.05 * step + nk[layer, step // 10]
            if metric == "pr_qk_weight" and h == -1:
                return 1.0 + 0.05 * step + nq[layer, step // 10]
            return base(layer, step, metric, h)
        write_run(root, f"r{s}", 2, "normal", s, values, levels=("weight",))
    write_sweep(root, [{"run_id": f"r{s}"} for s in range(6)])
    per_layer, _ = tj.layer_statistics(collate(root), levels=["weight"])
    step0 = per_layer[per_layer["origin"] == "step0"]
    assert (step0["rho_k_qk_levels"] < -0.9).all()
    assert step0["rho_k_qk"].abs().mean() < 0.5


def test_rho_of_a_trajectory_is_the_seed_mean_of_per_run_rho(tmp_path):
    rng = np.random.default_rng(3)
    noise = {s: rng.normal(scale=1.0, size=(2, 11)) for s in range(4)}
    base = monotone_values(wiggle=0.3)
    root = tmp_path / "rho"
    for s in range(4):
        def values(layer, step, metric, h, s=s):
            v = base(layer, step, metric, h)
            return v + noise[s][layer, step // 10] if (metric == "pr_qk_weight"
                                                       and h == -1) else v
        write_run(root, f"r{s}", 2, "normal", s, values, levels=("weight",))
    write_sweep(root, [{"run_id": f"r{s}"} for s in range(4)])
    per_layer, traj = tj.layer_statistics(collate(root), levels=["weight"])
    per_run = per_layer.groupby(["origin", "layer"])["rho_k_qk"].mean()
    traj = traj.set_index(["origin", "layer"])
    assert np.allclose(traj["rho_k_qk"], per_run.reindex(traj.index))
    steps = np.arange(0, 101, 10)
    k = 8.0 - 0.05 * steps + 0.3 * np.sin(steps)
    for layer in (0, 1):  # ρ of the seed-mean trajectory's changes kept beside, with its p
        qk = k / 2 + np.mean([noise[s][layer] for s in range(4)], axis=0)
        ref = sst.spearmanr(np.diff(k), np.diff(qk))
        assert traj.loc[("step0", layer), "rho_k_qk_of_mean"] == pytest.approx(ref.statistic)
        assert traj.loc[("step0", layer), "p_k_qk"] == pytest.approx(ref.pvalue)


def test_run_stats_of_nothing_is_an_empty_frame():
    assert tj.run_stats(pd.DataFrame()).empty
    assert stats.count_test([], 1)["n"] == 0
