"""The E1/E2 claims table: units, counts, p-values and verdicts on synthetic sweeps."""

from __future__ import annotations

import numpy as np
import pytest

from qkgeom.analysis import claims_table, collate
from qkgeom.analysis.e1.report import e1_claims

from .conftest import make_sweep, monotone_values

LEVELS, ORIGINS = ("weight", "token"), ("step0", "reference")


def _row(claims, claim_id, level="weight", origin="step0"):
    sel = claims[(claims["claim_id"] == claim_id) & (claims["level"] == level)
                 & (claims["origin"] == origin)]
    assert len(sel) == 1
    return sel.iloc[0]


def test_all_rise_is_supported_over_runs_and_the_diverged_run_is_left_out(all_rise):
    claims = claims_table(all_rise)
    # 6 claims; E2.3 is measured once per level -> 5*2*2 + 1*2 rows
    assert len(claims) == 22
    primary = claims[claims["role"] == "primary"]
    assert list(primary["claim_id"]) == ["E1.1", "E1.2", "E1.3", "E2.1", "E2.2", "E2.3"]
    assert set(primary["level"]) == {"token"}
    assert list(primary["origin"]) == ["reference"] * 5 + ["last"]
    assert set(primary["verdict"]) == {"supported"}
    assert set(claims["unit"]) == {"runs"}
    assert set(claims["n"]) == {9} and set(claims["k"]) == {9}  # 3 inits x 3 seeds
    assert np.allclose(claims["p_value"], 1 / 512)  # every run positive: 1 of 2^9 patterns
    assert np.allclose(claims["p_sign"], 1 / 512)
    assert np.allclose(primary["p_adj"], 6 / 512)  # Holm over the six primary rows
    secondary = claims[claims["role"] == "secondary"]
    assert np.allclose(secondary["p_adj"], 16 / 512) and (secondary["family"] == 16).all()
    row = _row(claims, "E1.1", "token", "reference")
    assert row["from"] == "reference, step 30"  # first probe at or after 25 % of 100 steps
    assert row["measured"] == "9/9 runs"
    assert row["mean"] == pytest.approx(0.05 * 70)  # ΔPR_Q from step 30 to 100
    assert row["ci_low"] == pytest.approx(row["mean"])  # identical runs: a zero-width interval
    assert "cells 3/3" in row["beside"] and "layer trajectories 12/12" in row["beside"]
    assert _row(claims, "E1.1")["mean"] == pytest.approx(0.05 * 100)
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
    step0 = _row(claims, "E1.1", "token", "step0")  # secondary: Holm over 16 rows
    assert step0["p_opposite_adj"] <= 16 / 512 and step0["verdict"] == "not supported"
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
