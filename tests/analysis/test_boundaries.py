"""Every decision rule of docs/protocols.md at its boundary: the verdict's shares and level,
the t-interval's level on cases with a closed form, two-sided p's, the E3 manipulation gate
at exactly halfway and the E3 windows, the E4 regime call (its point count, level, p,
peak and share lost), the warm-up window and E4.1, the E1 reference. A rule moved by one step (≥ to >, 95 % to
90 %, a factor 2 dropped) changes an answer here."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sst

from qkgeom.analysis import stats
from qkgeom.analysis.e1.trajectories import reference_probe
from qkgeom.analysis.e3 import e3_analysis
from qkgeom.analysis.e3.paired import in_windows
from qkgeom.analysis.e4.claims import e4_claims
from qkgeom.analysis.e4.regime import call_of, peak_stats, regime_calls, upper_p
from qkgeom.analysis.e4.trends import mann_kendall, rule_window
from qkgeom.config import TrainConfig

from .synthetic import Run, table_of

# --- the verdict rule ------------------------------------------------------------------------


@pytest.mark.parametrize("k, n", [(4, 5), (8, 10), (16, 20)])
def test_exactly_80_percent_with_p_below_alpha_is_supported(k: int, n: int) -> None:
    assert k / n == stats.SUPPORT_SHARE
    assert stats.verdict(k, n, 0.01) == "supported"
    assert stats.verdict(k - 1, n, 0.01) == "mixed"  # just below 80 %


@pytest.mark.parametrize("k, n", [(1, 2), (5, 10), (10, 20)])
def test_not_supported_needs_the_opposite_direction_significant(k: int, n: int) -> None:
    """Half the units, or none, with the predicted sign is not evidence against a claim:
    only a significant opposite effect is; without it the row is inconclusive."""
    assert stats.verdict(k, n, 1.0) == "inconclusive"
    assert stats.verdict(0, n, 1.0) == "inconclusive"
    assert stats.verdict(0, n, 1.0, p_opposite=np.nextafter(0.05, 0.0)) == "not supported"
    assert stats.verdict(0, n, 1.0, p_opposite=0.05) == "inconclusive"


def test_the_level_is_strict_p_at_005_is_not_enough() -> None:
    assert stats.verdict(5, 5, 0.05) == "inconclusive"
    assert stats.verdict(5, 5, np.nextafter(0.05, 1.0)) == "inconclusive"
    assert stats.verdict(5, 5, np.nextafter(0.05, 0.0)) == "supported"


def test_equivalence_at_its_boundary_and_before_every_other_verdict() -> None:
    """TOST below α: no effect larger than δ, even with a significant small effect."""
    assert stats.verdict(3, 10, 0.5, p_equiv=np.nextafter(0.05, 0.0)) == \
        "equivalent to no effect"
    assert stats.verdict(3, 10, 0.5, p_equiv=0.05) == "inconclusive"
    assert stats.verdict(10, 10, 1e-4, p_equiv=0.01) == "equivalent to no effect"
    assert stats.verdict(10, 10, 1e-4, p_equiv=0.01, reason="gate") == "not evaluated"


def test_equivalence_needs_five_units_on_the_row_itself() -> None:
    """Protocol 2: 4 units whose interval lies well inside ±δ are never *equivalent to no
    effect* (the S2 hold row of the stability demo was, on 4 seeds); 5 units can be. The
    minimum is the row's own n, whatever other rows of its table hold."""
    four = stats.unit_test([0.01, -0.01, 0.02, 0.0], 0, delta=0.1)
    assert four["p_equiv"] < 1e-3  # the interval is far inside ±0.1
    assert stats.verdict(four["k"], four["n"], four["p_value"],
                         p_equiv=four["p_equiv"]) == "inconclusive"
    five = stats.unit_test([0.01, -0.01, 0.02, 0.0, 0.01], 0, delta=0.1)
    assert stats.verdict(five["k"], five["n"], five["p_value"],
                         p_equiv=five["p_equiv"]) == "equivalent to no effect"
    assert stats.MIN_UNITS == 5
    assert stats.verdict(0, 4, 1.0, p_equiv=1e-9) == "inconclusive"
    assert stats.verdict(0, 5, 1.0, p_equiv=1e-9) == "equivalent to no effect"


def test_four_units_can_never_be_supported_five_can() -> None:
    """With n units no p goes below 2^−n: 4/4 gives 1/16 ≥ 0.05, 5/5 gives 1/32."""
    four = stats.unit_test([1.0, 2.0, 3.0, 4.0], +1)
    assert four["p_value"] == 1 / 16 and four["p_sign"] == pytest.approx(1 / 16)
    assert stats.verdict(four["k"], four["n"], four["p_value"]) == "inconclusive"
    five = stats.unit_test([1.0, 2.0, 3.0, 4.0, 5.0], +1)
    assert five["p_value"] == 1 / 32
    assert stats.verdict(five["k"], five["n"], five["p_value"]) == "supported"


def test_a_zero_counts_against_the_claim_at_the_boundary() -> None:
    """4 of 5 positive and a zero: 80 %; with the zero counted for the claim it would be
    5/5. The zero also cannot help the sign-flip sum (p = 2/32, not 1/32)."""
    u = stats.unit_test([1.0, 1.0, 1.0, 1.0, 0.0], +1)
    assert (u["k"], u["n"]) == (4, 5)
    assert u["p_value"] == pytest.approx(2 / 32)
    assert stats.verdict(u["k"], u["n"], u["p_value"]) == "inconclusive"


# --- intervals and two-sided p's -------------------------------------------------------------


def test_t_interval_level_on_closed_forms() -> None:
    """Student's t quantiles in closed form: df = 1, t(q) = tan(π(q − ½)); df = 2,
    t(q) = (2q − 1)/√(2q(1 − q)). The 95 % two-sided interval uses q = 0.975."""
    mean, lo, hi, n = stats.t_interval([0.0, 2.0])  # mean 1, sd √2, half = t·√2/√2
    t1 = math.tan(math.pi * 0.475)
    assert (mean, n) == (1.0, 2)
    assert hi - mean == pytest.approx(t1, rel=1e-12) and mean - lo == pytest.approx(t1, rel=1e-12)
    mean, lo, hi, n = stats.t_interval([0.0, 1.0, 2.0])  # mean 1, sd 1, half = t/√3
    t2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    assert hi - mean == pytest.approx(t2 / math.sqrt(3), rel=1e-12)
    assert stats.CI_LEVEL == 0.95


def test_two_sided_p_is_twice_the_smaller_one_sided_at_most_one() -> None:
    v = [3.0, -1.0, 2.0]  # signed sums 6, 4, 2, 0, 0, −2, −4, −6; observed 4
    assert stats.sign_flip_p(v, +1) == 2 / 8 and stats.sign_flip_p(v, -1) == 7 / 8
    two = stats.unit_test(v, 0)
    assert two["p_value"] == 2 * (2 / 8)
    assert two["k"] == 2 and two["p_sign"] == pytest.approx(2 * 0.5)  # P(≥ 2 of 3) = 1/2
    even = stats.unit_test([1.0, -1.0], 0)  # both one-sided p's are 3/4: capped at 1
    assert even["p_value"] == 1.0 and even["p_sign"] == 1.0


def test_mann_kendall_two_sided_is_twice_the_one_sided() -> None:
    up = mann_kendall([1.0, 2.0, 3.0, 4.0])
    z = 5 / math.sqrt(26 / 3)
    assert up["p_increase"] == pytest.approx(sst.norm.sf(z), rel=1e-12)
    assert up["p_two_sided"] == pytest.approx(2 * up["p_increase"], rel=1e-12)
    down = mann_kendall([4.0, 3.0, 2.0, 1.0])
    assert down["p_two_sided"] == pytest.approx(2 * down["p_decrease"], rel=1e-12)
    flat = mann_kendall([1.0, 2.0, 2.0, 1.0])  # S = 0: Z = 0, no evidence either way
    assert flat["s"] == 0 and flat["p_two_sided"] == 1.0


# --- E3: the manipulation gate and the windows -----------------------------------------------

E3_STEPS = list(range(0, 101, 10))


SHRINK, HOLD = "shrink-0.5-token-data", "hold-token-data"


def _e3_runs(shrink_k: dict[int, float], hold_k: dict[int, float]) -> list[Run]:
    """Two seeds of none, shrink (config dose 0.5, recorded r(t) = 0.25 throughout) and
    hold. The none run's token-level PR_K is 16 at step 0, then 4; shrink's and hold's are
    16 at step 0, then the given value per seed (in layer 0; layer 1 is on target).
    Intended: shrink 0.25, hold 16/4 = 4. Halfway on the log scale (protocol 2): shrink
    √0.25 = 0.5 (PR_K 2), hold √4 = 2 (PR_K 8); on the plain ratio (protocol 1): shrink
    (1 + 0.25)/2 = 0.625 (PR_K 2.5), hold (1 + 4)/2 = 2.5 (PR_K 10). Dyadic numbers: every
    ratio and mean is exact."""
    t = np.asarray(E3_STEPS)
    runs = []
    for seed in (0, 1):
        for arm, control, later in (("none", {"mode": "none"}, 4.0),
                                    (SHRINK, {"mode": "shrink", "dose": 0.5}, shrink_k[seed]),
                                    (HOLD, {"mode": "hold"}, hold_k[seed])):
            on_target = {"none": 4.0, SHRINK: 1.0, HOLD: 16.0}[arm]
            k = np.stack([np.where(t == 0, 16.0, later), np.where(t == 0, 16.0, on_target)])
            ent = np.full((2, len(t)), 2.0) - 0.1 * (arm == SHRINK) * (t > 0)
            extra = ({"ctl_dose_l0": np.full(len(t), 0.25),
                      "ctl_dose_l1": np.full(len(t), 0.25)} if arm == SHRINK else {})
            runs.append(Run(f"seed={seed},arm={arm}", seed, control=control, pair_key=str(seed),
                            layers={"pr_k_token": k, "pr_k_weight": k, "attn_entropy": ent,
                                    "attn_entropy_scalefree": ent, "pr_qk_token": k / 2},
                            extra=extra))
    return runs


def _gate(shrink_k: dict[int, float], hold_k: dict[int, float]) -> dict:
    a = e3_analysis(table_of(_e3_runs(shrink_k, hold_k), E3_STEPS, ref_step=25))
    units = a["manipulation_units"]
    man = units[units["unit"] == "l0"].set_index(["arm", "seed", "window"])
    claims = a["claims"][a["claims"]["role"] == "primary"].set_index("claim_id")
    return {"man": man, "claims": claims}


def test_manipulation_check_passes_at_exactly_halfway_on_the_log_scale() -> None:
    """Protocol 2: a 0.25× shrink at 0.5 and a 4× hold at 2 achieved exactly half their
    log change: both pass. Protocol 1's gate, beside, fails the hold (it asked for 2.5,
    66 % of the log change)."""
    r = _gate({0: 2.0, 1: 1.0}, {0: 8.0, 1: 16.0})
    shrink, hold = r["man"].loc[(SHRINK, 0, "whole")], r["man"].loc[(HOLD, 0, "whole")]
    assert (shrink["achieved"], shrink["intended"], shrink["threshold"]) == (0.5, 0.25, 0.5)
    assert (hold["achieved"], hold["intended"], hold["threshold"]) == (2.0, 4.0, 2.0)
    assert shrink["passed"] is True and hold["passed"] is True
    assert shrink["log_share"] == pytest.approx(0.5) and hold["log_share"] == pytest.approx(0.5)
    assert (shrink["threshold_p1"], hold["threshold_p1"]) == (0.625, 2.5)
    assert shrink["passed_p1"] is True and hold["passed_p1"] is False
    for cid in ("E3.1", "E3.2"):
        assert r["claims"].loc[cid, "verdict"] != "not evaluated"
    assert r["claims"].loc["E3.2", "verdict_gate_p1"] == "not evaluated"


def test_manipulation_check_fails_just_past_halfway_on_the_log_scale() -> None:
    over = np.nextafter(2.0, 3.0)  # shrink achieved just above √0.25 (× the none run's 4)
    under = np.nextafter(8.0, 7.0)  # hold achieved just below √4
    r = _gate({0: over, 1: 1.0}, {0: under, 1: 16.0})
    assert r["man"].loc[(SHRINK, 0, "whole"), "passed"] is False
    assert r["man"].loc[(SHRINK, 1, "whole"), "passed"] is True
    assert r["man"].loc[(HOLD, 0, "whole"), "passed"] is False
    for cid in ("E3.1", "E3.2"):
        row = r["claims"].loc[cid]
        assert row["verdict"] == "not evaluated"
        assert "manipulation check failed in 1/2 seeds (1 unit(s)): seed 0, l0" in row["reason"]
    assert r["claims"].loc["E3.1", "verdict_gate_p1"] != "not evaluated"  # 0.5 ≤ 0.625


def test_protocol_1s_gate_beside_is_halfway_on_the_plain_ratio() -> None:
    """Protocol 1's column at its own boundary: (1 + 0.25)/2 = 0.625 and (1 + 4)/2 = 2.5
    pass exactly, one representable number past them fail."""
    at = _gate({0: 2.5, 1: 1.0}, {0: 10.0, 1: 16.0})["man"]
    past = _gate({0: np.nextafter(2.5, 3.0), 1: 1.0}, {0: np.nextafter(10.0, 9.0), 1: 16.0})
    for arm in (SHRINK, HOLD):
        assert at.loc[(arm, 0, "whole"), "passed_p1"] is True
        assert past["man"].loc[(arm, 0, "whole"), "passed_p1"] is False
    assert at.loc[(SHRINK, 0, "whole"), "passed"] is False  # 0.625 > √0.25
    assert at.loc[(HOLD, 0, "whole"), "passed"] is True  # 2.5 ≥ √4


def test_e3_windows_include_the_quarter_and_leave_out_step_0() -> None:
    frame = pd.DataFrame({"group": 0, "step": [0, 10, 25, 26, 100, 101]})
    got = in_windows(frame, {0: 100}).groupby("window")["step"].apply(list).to_dict()
    assert got == {"early": [10, 25], "whole": [10, 25, 26, 100]}


# --- E4: the regime call, the warm-up window and E4.1 ------------------------------------------


def _call(values) -> dict:
    return regime_calls(np.asarray(values, dtype=float)[None, :]).row(0)


def test_four_checkpoints_get_a_call_and_three_do_not() -> None:
    assert _call([0.0, 1.0, 2.0, 3.0])["call"] == "monotone rise"
    three = _call([0.0, 1.0, 2.0])
    assert three["call"] == "no trend" and np.isnan(three["p_rise"])


def test_the_regime_level_is_strict() -> None:
    p = np.array([stats.ALPHA, np.nextafter(stats.ALPHA, 0.0)])
    call, _ = call_of(p, p, np.ones(2), np.ones(2))
    assert list(call) == ["no trend", "rise then fall"]


def test_the_surrogate_p_counts_the_data_and_ties() -> None:
    """p = (1 + #{null ≥ observed}) / (1 + S); the mid-p counts ties half."""
    p, mid = upper_p(np.array([[1.0, 2.0, 3.0]]), np.array([[3.0]]))
    assert p[0, 0] == pytest.approx(2 / 4) and mid[0, 0] == pytest.approx(1 / 4)
    p, _ = upper_p(np.array([[1.0, 2.0, 3.0]]), np.array([[3.5]]))
    assert p[0, 0] == pytest.approx(1 / 4)  # beyond every surrogate: 1/(1 + S), never 0


def test_the_peak_is_the_first_largest_and_the_share_lost_needs_a_significant_rise() -> None:
    peak, gain, drop = peak_stats(np.array([[0.0, 5.0, 5.0, 1.0]]))
    assert (peak[0], gain[0], drop[0]) == (1, 5.0, 4.0)
    _, lost = call_of(np.array([0.01, 0.5]), np.array([0.01, 0.01]), np.array([2.0, 2.0]),
                      np.array([1.0, 1.0]))
    assert lost[0] == pytest.approx(0.5) and np.isnan(lost[1])


def test_the_checkpoint_where_the_warm_up_ends_is_in_the_rule() -> None:
    assert list(rule_window(np.array([99.0, 100.0, 101.0]), 100)) == [False, True, True]
    assert rule_window(np.array([0.0, 5.0]), None).all()


def _one_layer(p_fall: float) -> pd.Series:
    trends = pd.DataFrame({"metric": "contrast_token_heads", "level": "token_heads",
                           "layer": [0], "n": 8, "call": "fall", "p_rise": 1.0,
                           "p_fall": p_fall, "z_rise": -1.0, "z_fall": 2.0,
                           "share_lost": np.nan, "peak_step": 100.0})
    heads = pd.DataFrame(columns=["checkpoint", "step", "level", "layer", "n_heads", "rho", "p"])
    return e4_claims(trends, heads).set_index(["claim_id", "level"]).loc[("E4.1",
                                                                          "token_heads")]


def test_e4_1_of_one_model_is_its_sidak_p_at_a_strict_level() -> None:
    assert _one_layer(stats.ALPHA)["verdict"] == "inconclusive"  # no fall shown: no verdict
    below = _one_layer(np.nextafter(stats.ALPHA, 0.0))
    assert (below["k"], below["n"], below["verdict"]) == (1, 1, "supported")


# --- E1: the reference -----------------------------------------------------------------------


def test_the_reference_is_the_first_probe_at_or_after_a_quarter_of_the_run() -> None:
    assert TrainConfig(steps=100).ref_step == 25
    assert TrainConfig.ref_step_of(30) == 8  # 7.5 rounded up
    assert TrainConfig(steps=100, reference_step=0).ref_step == 0  # explicit wins
    assert reference_probe([0, 10, 20, 25, 30], 25) == 25  # at: that probe
    assert reference_probe([0, 10, 20, 30], 25) == 30  # else the next one
