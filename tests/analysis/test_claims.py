"""The claims table: known counts, p-values and verdicts on synthetic sweeps."""

from __future__ import annotations

import numpy as np
import pytest

from qkgeom.analysis import claims_table, stats

from .conftest import make_sweep, monotone_values


def _row(claims, claim_id, level="weight", origin="step0"):
    sel = claims[(claims["claim_id"] == claim_id) & (claims["level"] == level)
                 & (claims["origin"] == origin)]
    assert len(sel) == 1
    return sel.iloc[0]


def test_all_rise_is_supported_everywhere_and_diverged_run_is_left_out(all_rise):
    claims = claims_table(all_rise, n_boot=100)
    # 6 claims; E2.3 is measured once per level -> 5*2*2 + 1*2 rows
    assert len(claims) == 22
    assert set(claims["verdict"]) == {"supported"}
    assert set(claims["n"]) == {12}  # 4 layers x 3 inits; the diverged seed adds nothing
    assert set(claims["k"]) == {12}
    assert np.allclose(claims["p_value"], 0.5**12)
    row = _row(claims, "E1.1", "token", "reference")
    assert row["from"] == "reference, step 20"
    assert row["measured"].startswith("12/12 trajectories")
    assert row["mean"] == pytest.approx(0.05 * 80)  # ΔPR_Q from step 20 to 100
    assert _row(claims, "E1.1")["mean"] == pytest.approx(0.05 * 100)
    assert [r["run_id"] for r in claims.attrs["excluded"]] == ["n_layer4-qk_init-normal-seed9"]


def test_half_rise_is_not_supported(half_rise):
    claims = claims_table(half_rise, n_boot=50)
    for level in stats.LEVELS:
        for origin in stats.ORIGINS:
            row = _row(claims, "E1.1", level, origin)
            assert (row["k"], row["n"]) == (6, 12)
            assert row["p_value"] == pytest.approx(stats.binomial_p(6, 12))
            assert row["verdict"] == "not supported"
            assert _row(claims, "E1.2", level, origin)["verdict"] == "supported"


def test_three_of_four_is_mixed_with_p_five_sixteenths(tmp_path):
    root = make_sweep(tmp_path / "s", monotone_values(lambda layer: 1 if layer < 3 else -1),
                      inits=("normal",), seeds=(0, 1))
    row = _row(claims_table(root, n_boot=50), "E1.1")
    assert (row["k"], row["n"]) == (3, 4)
    assert row["p_value"] == pytest.approx(5 / 16, abs=1e-12)
    assert row["verdict"] == "mixed"


def test_transient_flips_the_verdict_between_origins(tmp_path):
    """PR_Q drops until the reference step (20) and then rises: not supported from step 0,
    supported from the reference — the table says which is which."""
    base = monotone_values()

    def transient(layer, step, metric, head):
        q = 20.0 - 0.75 * step if step <= 20 else 5.0 + 0.125 * (step - 20)
        if metric.startswith("pr_q_"):
            return q
        if metric.startswith("contrast_"):
            return q - base(layer, step, "pr_k_weight", head)
        return base(layer, step, metric, head)

    root = make_sweep(tmp_path / "tr", transient, depths=(2,), inits=("normal", "tied"),
                      seeds=(0,), n_head=3)
    claims = claims_table(root, n_boot=20)
    assert _row(claims, "E1.1", "weight", "step0")["verdict"] == "not supported"
    ref = _row(claims, "E1.1", "weight", "reference")
    assert (ref["k"], ref["n"]) == (4, 4)
    assert ref["verdict"] == "mixed"  # 4/4 but p = 1/16: too few trajectories for 'supported'


def test_universal_claim_needs_every_trajectory(tmp_path):
    """Contrast dips below zero once in one layer: E1.3 is not 'supported' even though the
    time average stays positive everywhere."""
    base = monotone_values()

    def dip(layer, step, metric, head):
        v = base(layer, step, metric, head)
        if layer == 0 and step == 50 and metric.startswith("contrast_"):
            return -0.5
        if layer == 0 and step == 50 and metric.startswith("pr_q_"):
            return base(layer, step, "pr_k_weight", head) - 0.5
        return v

    root = make_sweep(tmp_path / "dip", dip, depths=(4,), inits=("normal", "tied"), seeds=(0,))
    row = _row(claims_table(root, n_boot=20), "E1.3")
    assert (row["k"], row["n"]) == (6, 8)
    assert "time-averaged contrast > 0: 8/8" in row["measured"]
    assert row["verdict"] == "mixed"


def test_weight_only_runs_leave_token_claims_not_evaluated(tmp_path):
    root = make_sweep(tmp_path / "w", monotone_values(), inits=("normal",), seeds=(0,),
                      levels=("weight",))
    claims = claims_table(root, n_boot=10)
    assert set(claims.loc[claims["level"] == "token", "verdict"]) == {"not evaluated"}
    assert _row(claims, "E1.1", "weight")["n"] == 4
    # no attention entropy at all: E2.2 cannot be measured at the weight level either
    assert _row(claims, "E2.2", "weight")["verdict"] == "not evaluated"
