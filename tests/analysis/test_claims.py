"""The E1/E2 claims table: units, counts, p-values and verdicts on synthetic sweeps."""

from __future__ import annotations

import numpy as np
import pytest

from qkgeom.analysis import claims_table, collate
from qkgeom.analysis.e1.report import e1_claims

from .conftest import make_sweep, monotone_values

LEVELS, ORIGINS = ("weight", "token"), ("step0", "reference")


def _row(claims, claim_id, level="weight", origin="step0"):
    """The layer-mean row of the claim's own statistic at ``level`` and ``origin``."""
    main = {"E2.1": "rho_k_qk_vs_null", "E2.2": "rho_qk_entropy_vs_null"}
    stat = claims["statistic"].where(~claims["claim_id"].isin(main),
                                     claims["claim_id"].map(main))
    sel = claims[(claims["claim_id"] == claim_id) & (claims["level"] == level)
                 & (claims["origin"] == origin) & claims["layer"].isna()
                 & (claims["statistic"] == stat)]
    assert len(sel) == 1
    return sel.iloc[0]


def test_all_rise_is_supported_over_runs_and_the_diverged_run_is_left_out(all_rise):
    claims = claims_table(all_rise)
    # 6 claims at 2 levels x 2 origins (E2.3: 2 levels), E2.1/E2.2 also without the
    # cross-run null, and one row per claim and layer: 5*4 + 2 + 2*4 + 6*4 rows
    assert len(claims) == 54
    mean_rows = claims[claims["layer"].isna()]
    assert len(mean_rows) == 30
    primary = claims[claims["role"] == "primary"]
    assert list(primary["claim_id"]) == ["E1.1", "E1.2", "E1.3", "E2.1", "E2.2", "E2.3"]
    assert list(primary["statistic"]) == ["delta_pr_q", "delta_pr_k", "contrast_time_mean",
                                          "rho_k_qk_vs_null", "rho_qk_entropy_vs_null",
                                          "rho_heads_qk_entropy"]
    assert set(primary["level"]) == {"token"}
    assert list(primary["origin"]) == ["reference"] * 5 + ["last"]
    # every run follows one and the same profile: E2's within-run ρ is all shared profile,
    # so the cross-run null takes all of it (0 counts against); the rest is supported
    by_id = primary.set_index("claim_id")
    assert set(by_id.loc[["E1.1", "E1.2", "E1.3", "E2.3"], "verdict"]) == {"supported"}
    assert set(by_id.loc[["E2.1", "E2.2"], "verdict"]) == {"inconclusive"}
    assert (by_id.loc[["E2.1", "E2.2"], "mean"] == 0).all()
    within = mean_rows[mean_rows["statistic"].isin(["rho_k_qk", "rho_qk_entropy"])]
    assert len(within) == 8 and (within["role"] == "secondary").all()
    assert (within["k"] == 9).all()  # protocol 1's row: 9/9, the shared profile passes it
    assert set(claims["unit"]) == {"runs"}
    assert set(claims["n"]) == {9}  # 3 inits x 3 seeds
    positive = ~claims["statistic"].str.endswith("_vs_null")
    assert set(claims.loc[positive, "k"]) == {9}
    assert np.allclose(claims.loc[positive, "p_value"], 1 / 512)  # 1 of 2^9 patterns
    assert np.allclose(claims.loc[positive, "p_sign"], 1 / 512)
    assert np.allclose(by_id.loc[["E1.1", "E1.2", "E1.3", "E2.3"], "p_adj"], 6 / 512)
    secondary = claims[claims["role"] == "secondary"]
    assert (secondary["family"] == 48).all()
    assert np.allclose(secondary.loc[positive, "p_adj"], 48 / 512)
    row = _row(claims, "E1.1", "token", "reference")
    assert row["from"] == "reference, step 30"  # first probe at or after 25 % of 100 steps
    assert row["measured"] == "9/9 runs"
    assert row["mean"] == pytest.approx(0.05 * 70)  # ΔPR_Q from step 30 to 100
    assert row["ci_low"] == pytest.approx(row["mean"])  # identical runs: a zero-width interval
    assert "cells 3/3" in row["beside"] and "layer trajectories 12/12" in row["beside"]
    assert _row(claims, "E1.1")["mean"] == pytest.approx(0.05 * 100)
    layer2 = claims[(claims["claim_id"] == "E1.1") & (claims["layer"] == 2)].iloc[0]
    assert layer2["from"] == "reference, step 30 · layer 2" and layer2["role"] == "secondary"
    assert "layer trajectories 3/3" in layer2["beside"]  # layer 2 of the 3 cells
    assert list(collate(all_rise).excluded["run_id"]) == ["n_layer4-qk_init-normal-seed9"]


def test_half_of_the_layers_rising_is_not_a_layer_count(half_rise):
    """PR_Q rises in layers 0–1 and falls in 2–3 by as much: each run's whole-model ΔPR_Q
    (the layer mean) is 0.05·100·(1 + 1 − 1 − 1)/4 + a layer offset of 0 = 0, which counts
    against the claim but is no evidence either way (inconclusive); the 6/12 layer
    trajectories are shown beside, never tested."""
    claims = claims_table(half_rise)
    for level in LEVELS:
        for origin in ORIGINS:
            row = _row(claims, "E1.1", level, origin)
            assert (row["k"], row["n"]) == (0, 9)
            assert row["verdict"] == "inconclusive"
            assert "layer trajectories 6/12" in row["beside"]
    assert _row(claims, "E1.2", "token", "reference")["verdict"] == "supported"


def test_seven_runs_are_the_least_that_can_support_an_e1_claim(tmp_path):
    """Six primary rows, Holm-adjusted together: with every run agreeing, 6/2^6 > 0.05 and
    6/2^7 < 0.05."""
    six = make_sweep(tmp_path / "six", monotone_values(wiggle=0.3), inits=("normal", "tied"),
                     seeds=(0, 1, 2))
    row = _row(claims_table(six), "E1.1", "token", "reference")
    assert (row["k"], row["n"]) == (6, 6) and row["p_value"] == pytest.approx(1 / 64)
    assert row["p_adj"] == pytest.approx(6 / 64) and row["verdict"] == "inconclusive"
    seven = make_sweep(tmp_path / "seven", monotone_values(wiggle=0.3), inits=("normal",),
                       seeds=tuple(range(7)))
    row = _row(claims_table(seven), "E1.1", "token", "reference")
    assert row["p_adj"] == pytest.approx(6 / 128) and row["verdict"] == "supported"


def test_a_transient_flips_the_verdict_between_origins(tmp_path):
    """PR_Q drops until step 20 and then rises: it shrinks from step 0 but expands from the
    reference (step 30) — the table says which is which."""
    base = monotone_values()

    def transient(layer, step, metric, head):
        q = 20.0 - 0.75 * step if step <= 20 else 5.0 + 0.125 * (step - 20)
        if metric.startswith("pr_q_"):
            return q
        if metric.startswith("contrast_"):
            return q - base(layer, step, "pr_k_weight", head)
        return base(layer, step, metric, head)

    root = make_sweep(tmp_path / "tr", transient, depths=(2,), inits=("normal",),
                      seeds=tuple(range(9)), n_head=3)
    claims = claims_table(root)
    step0 = _row(claims, "E1.1", "token", "step0")  # secondary: Holm over the measured rows
    assert step0["p_opposite_adj"] <= step0["family"] / 512
    assert step0["verdict"] == "not supported"
    ref = _row(claims, "E1.1", "token", "reference")  # the primary row
    assert (ref["k"], ref["n"]) == (9, 9) and ref["verdict"] == "supported"


def test_universal_e13_needs_every_layer_trajectory(tmp_path):
    """The contrast of layer 0 is below zero for the last 30 % of the run in every seed: every
    run's time average (the layer mean) stays positive, but one layer trajectory's does not,
    so "in all trajectories" is not supported; the four readings are reported side by side."""
    base = monotone_values()

    def late_dip(layer, step, metric, head):
        v = base(layer, step, metric, head)
        if layer == 0 and step >= 70 and metric.startswith(("contrast_", "pr_q_")):
            return v - 30.0
        return v

    root = make_sweep(tmp_path / "dip", late_dip, depths=(4,), inits=("normal",),
                      seeds=tuple(range(7)))
    e1 = e1_claims(collate(root))
    row = _row(e1["claims"], "E1.3", "token", "reference")
    assert (row["k"], row["n"]) == (7, 7) and row["p_value"] == pytest.approx(1 / 128)
    assert "layer trajectories 3/4" in row["beside"]
    assert row["verdict"] == "mixed"
    readings = e1["readings"]
    sel = readings[(readings["level"] == "weight") & (readings["origin"] == "step0")]
    by = sel.set_index("reading")
    assert list(by.index) == ["a", "b", "c", "d"] and by.loc["c", "primary"]
    assert (by.loc["a", "traj_k"], by.loc["b", "traj_k"], by.loc["c", "traj_k"]) == (3, 3, 3)
    assert (by.loc["d", "traj_k"], by.loc["d", "traj_n"]) == (3, 4)


def test_weight_only_runs_leave_token_claims_not_evaluated(tmp_path):
    root = make_sweep(tmp_path / "w", monotone_values(), inits=("normal",), seeds=(0,),
                      levels=("weight",))
    claims = claims_table(root)
    assert set(claims.loc[claims["level"] == "token", "verdict"]) == {"not evaluated"}
    assert _row(claims, "E1.1", "weight")["n"] == 1
    # no attention entropy at all: E2.2 cannot be measured at the weight level either
    assert _row(claims, "E2.2", "weight")["verdict"] == "not evaluated"
