"""The stability analysis on synthetic runs with a planted remedy effect and with none: the
claims (S1, S2, S3), the learning-rate sweep (LR sensitivity, widest stable range), the
alert replay's counts and lead times, the calibration of the scale-free candidates, the
cross-size table, the report from folders; and the experiment end to end on real (smoke)
runs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from qkgeom.alerts import (
    AlertRule,
    attention_peak,
    entropy_norm_collapse,
    logit_growth,
    replay,
)
from qkgeom.analysis.stability.alerts import (
    alert_summary,
    calibrate,
    candidate_rules,
    choose_defaults,
    evaluate,
    log_rates,
    sparse,
    warned_sentence,
)
from qkgeom.analysis.stability.claims import stability_claims
from qkgeom.analysis.stability.outcomes import StabilityRuns, read_trials, stability_runs
from qkgeom.analysis.stability.power import power_table
from qkgeom.analysis.stability.sensitivity import (
    lr_sensitivity,
    rate_table,
    widest_stable_range,
)
from qkgeom.analysis.stability.transfer import Source, requirements, rule_sets, transfer_table

from .stability_data import (
    HIGH,
    LEFT_OUT,
    STABLE,
    synthetic,
    write_stability_sweep,
    write_trial_runs,
)

LRS = (3e-4, STABLE, 3e-2, 3e-1)


def _primary(claims: pd.DataFrame, claim_id: str, lr: float | None = None) -> pd.Series:
    rows = claims[(claims["role"] == "primary") & (claims["claim_id"] == claim_id)]
    if lr is not None:
        rows = rows[np.isclose(rows["lr"], lr)]
    assert len(rows) == 1
    return rows.iloc[0]


# ------------------------------------------------------------------ claims


def test_a_planted_remedy_is_found_and_costs_nothing_at_the_stable_lr() -> None:
    stab = synthetic(6, planted=True)
    runs = stab.runs.set_index("run_id")
    assert runs["collapsed"].groupby([runs["lr"], runs["arm"]]).sum().to_dict() == {
        (STABLE, "fix"): 0, (STABLE, "none"): 0, (HIGH, "fix"): 0, (HIGH, "none"): 6}
    claims = stability_claims(stab)
    s1, s2 = _primary(claims, "S1", HIGH), _primary(claims, "S2", STABLE)
    assert s1["verdict"] == "supported"
    assert s1["mean"] == pytest.approx(-0.3, abs=0.02) and s1["k"] == 6
    assert s2["verdict"] == "equivalent to no effect"
    assert "collapsed: fix 0/6, none 6/6" in s1["beside"]


def test_s2_rows_are_equivalence_claims_not_a_predicted_sign() -> None:
    claims = stability_claims(synthetic(5, planted=True))
    s2 = _primary(claims, "S2", STABLE)
    assert s2["predicted"] == "no cost within ±0.05 (equivalence)"
    assert "costs nothing" in s2["claim"] and "TOST ±0.05" in s2["test"]
    assert _primary(claims, "S1", HIGH)["predicted"] == "Δ < 0"


def test_no_remedy_effect_is_not_called_one() -> None:
    """The remedy arm collapses like none: S1 and S3 are not supported (in several null
    data sets), S2 still equivalent."""
    for seed in range(4):
        claims = stability_claims(synthetic(6, planted=False, seed=seed, lrs=LRS))
        for lr in (3e-2, 3e-1):
            assert _primary(claims, "S1", lr)["verdict"] in (
                "inconclusive", "not supported", "equivalent to no effect")
        assert _primary(claims, "S3")["verdict"] != "supported"
        assert _primary(claims, "S2", STABLE)["verdict"] == "equivalent to no effect"


def test_s3_finds_a_planted_lower_lr_sensitivity() -> None:
    claims = stability_claims(synthetic(6, planted=True, lrs=LRS))
    s3 = _primary(claims, "S3")
    assert s3["verdict"] == "supported" and s3["k"] == 6 and s3["level"] == "4 rates"
    # none: 0.3 nats above its best at the 2 collapsing rates of 4 -> LS 0.15; fix ~0
    assert s3["mean"] == pytest.approx(-0.15, abs=0.02)
    assert set(claims["claim_id"]) == {"S1", "S2", "S3", "low"}


def test_rates_below_the_stable_one_are_secondary_and_two_sided() -> None:
    claims = stability_claims(synthetic(5, planted=True, lrs=LRS))
    low = claims[np.isclose(claims["lr"], 3e-4)]
    assert len(low) == 3 and set(low["role"]) == {"secondary"}
    assert set(low["claim_id"]) == {"low"}
    assert set(low["predicted"]) == {"no prediction (two-sided)"}
    assert low["test"].str.contains("two-sided").all()
    assert not claims[claims["role"] == "primary"]["lr"].lt(STABLE - 1e-12).any()


def test_pairs_stay_within_a_size() -> None:
    """Two sizes whose losses differ by a constant: pairing across sizes would add it to
    every difference; within a size the planted -0.3 comes back."""
    stab = synthetic(6, planted=True, sizes=("a", "b"))
    stab.val.loc[stab.val["run_id"].str.contains("size=b"), "val_loss"] += 1.0
    stab = stability_runs(stab.runs[["run_id", "arm", "size", "lr", "seed", "state", "steps",
                                     "diverged_step"]], stab.layers, stab.val, LEFT_OUT, "x")
    claims = stability_claims(stab)
    s1 = claims[(claims["claim_id"] == "S1") & (claims["role"] == "primary")]
    assert sorted(s1["size"]) == ["a", "b"]
    assert s1["mean"].to_numpy() == pytest.approx([-0.3, -0.3], abs=0.02)
    runs = stab.runs.set_index("run_id")
    assert runs.loc["size=b,lr=0.03,seed=0,arm=none", "departure_step"] == 30


def test_the_power_table_reads_the_measured_spread() -> None:
    claims = stability_claims(synthetic(6, planted=True, lrs=LRS))
    power = power_table(claims).set_index(["claim_id", "level"])
    s1 = power.loc[("S1", "lr 0.03")]
    sd = claims[(claims["claim_id"] == "S1") & (claims["role"] == "primary")
                & np.isclose(claims["lr"], 3e-2)]["sd"].iloc[0]
    assert s1["sd"] == pytest.approx(sd) and s1["effect"] == 0.1
    assert s1["power"] > 0.99 and s1["seeds_for_80"] <= 3  # noise 0.005-0.03 nats
    assert power.loc[("S2", "lr 0.003"), "effect"] == 0.05


# ------------------------------------------------------------------ the learning-rate sweep


def _hand(cases: list[tuple[str, float, int, float, str, bool]], l0: float = 4.0):
    """Runs from ``(arm, lr, seed, final val loss, state, collapsed)``, each with val loss
    ``l0`` at step 0."""
    runs, layers, vals = [], [], []
    for arm, lr, seed, final, state, collapsed in cases:
        rid = f"lr={lr},seed={seed},arm={arm}"
        runs.append({"run_id": rid, "arm": arm, "lr": lr, "seed": seed, "state": state,
                     "steps": 100, "diverged_step": 50.0 if state == "diverged" else np.nan})
        ent = 0.1 if collapsed else 2.0
        layers.append(pd.DataFrame({"run_id": rid, "step": [0, 100], "layer": 0,
                                    "metric": "attn_entropy", "value": [3.0, ent]}))
        layers.append(pd.DataFrame({"run_id": rid, "step": [0, 100], "layer": 0,
                                    "metric": "logit_max", "value": [1.0, 10.0]}))
        vals.append(pd.DataFrame({"run_id": rid, "step": [0, 100], "val_loss": [l0, final]}))
    return stability_runs(pd.DataFrame(runs), pd.concat(layers), pd.concat(vals), LEFT_OUT,
                          "hand")


def test_lr_sensitivity_by_hand_with_a_diverged_run_at_l0() -> None:
    stab = _hand([("none", 1e-3, 0, 2.5, "done", False), ("none", 1e-2, 0, 2.0, "done", False),
                  ("none", 1e-1, 0, np.nan, "diverged", True),
                  ("fix", 1e-3, 0, 2.4, "done", False), ("fix", 1e-2, 0, 2.1, "done", False),
                  ("fix", 1e-1, 0, 4.5, "done", True)])  # above L0: clipped to 4.0
    ls = lr_sensitivity(stab).set_index("arm")
    assert ls.loc["none", "sensitivity"] == pytest.approx((0.5 + 0.0 + 2.0) / 3)
    assert ls.loc["fix", "sensitivity"] == pytest.approx((0.3 + 0.0 + 1.9) / 3)
    assert ls.loc["none", "best_loss"] == 2.0 and ls.loc["none", "initial_val_loss"] == 4.0
    # a seed missing a rate has no LS
    short = _hand([("none", 1e-3, 0, 2.5, "done", False), ("none", 1e-2, 0, 2.0, "done", False),
                   ("none", 1e-3, 1, 2.5, "done", False)])
    assert np.isnan(lr_sensitivity(short).set_index("seed").loc[1, "sensitivity"])


def test_widest_stable_range_by_hand() -> None:
    lrs = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1]
    assert widest_stable_range(lrs, [True, False, True, True, False, True, True]) == (
        3e-2, 1e-1)  # two runs of two: the higher one
    assert widest_stable_range(lrs, [True, True, True, False, True, True, False]) == (
        1e-4, 1e-3)
    assert all(math.isnan(x) for x in widest_stable_range(lrs[:2], [False, False]))
    stab = _hand([("none", 1e-3, 0, 2.5, "done", False), ("none", 1e-2, 0, 2.0, "done", False),
                  ("none", 1e-2, 1, 2.1, "done", True), ("none", 1e-3, 1, 2.4, "done", False),
                  ("fix", 1e-3, 0, 2.4, "done", False), ("fix", 1e-2, 0, 2.2, "done", False),
                  ("fix", 1e-3, 1, 2.4, "done", False), ("fix", 1e-2, 1, 2.2, "done", False)])
    t = rate_table(stab).set_index("arm")
    assert (t.loc["none", "range_low"], t.loc["none", "range_high"]) == (1e-3, 1e-3)
    assert t.loc["none", "range_decades"] == 0.0 and t.loc["none", "stable_rates"] == 1
    assert t.loc["fix", "range_decades"] == pytest.approx(1.0)
    assert t.loc["none", "best_lr"] == 1e-2  # median of 2.0 and 2.1 beats 2.45
    assert t.loc["fix", "best_lr"] == 1e-2


# ------------------------------------------------------------------ alerts on runs


def test_replay_fires_like_the_monitor_once_per_crossing_with_its_step() -> None:
    metrics = pd.DataFrame({"step": [0, 5, 10, 15, 20], "layer": 0, "head": -1,
                            "metric": "logit_max", "value": [1, 80, 60, 90, 95.0]})
    fired = replay(metrics, (logit_growth(74.0),))
    assert [(a.step, a.value) for a in fired] == [(5, 80.0), (15, 90.0)]  # re-armed at 10
    rel = AlertRule("half", "logit_max", below=0.5, relative=True, from_step=10)
    assert [a.step for a in replay(metrics, (rel,))] == []  # baseline 60 at step 10: never < 30
    assert sorted(sparse(metrics, 2)["step"]) == [0, 10, 20]


def test_alert_precision_recall_and_lead_time_on_recorded_runs() -> None:
    stab = synthetic(5, planted=True)
    rules = (logit_growth(74.0), attention_peak(0.75))
    alerts = evaluate(stab, rules).set_index("run_id")
    s = alert_summary(alerts.reset_index())
    assert (s["false_alarms"], s["negatives"]) == (0, 15)  # every run but none at 3e-2
    assert (s["positives_warned"], s["positives"], s["low_entropy_healthy"]) == (5, 5, 0)
    assert s["precision"] == 1.0 and s["recall"] == 1.0
    assert s["warned_before_departure"] == 5
    for rid, r in alerts[alerts["collapsed"]].iterrows():
        rows = stab.layers[stab.layers["run_id"] == rid].assign(head=-1)
        first = min(a.step for a in replay(rows.drop(columns="run_id"), rules))
        assert r["first_alert_step"] == first
        assert r["lead_steps"] == r["departure_step"] - first > 0
    noisy = evaluate(stab, (logit_growth(0.0),))  # fires on every probe
    assert alert_summary(noisy)["false_alarms"] == 15
    assert alert_summary(noisy)["precision"] == pytest.approx(5 / 20)


def _alert_frame(collapsed: list[bool], alerted: list[bool], departure: list[float],
                 lead: list[float]) -> pd.DataFrame:
    """An :func:`evaluate`-shaped table by hand (a positive: collapsed and departed)."""
    frame = pd.DataFrame({"collapsed": collapsed, "alerted": alerted,
                          "departure_step": departure, "lead_steps": lead})
    return frame.assign(positive=frame["collapsed"] & frame["departure_step"].notna())


def test_the_warned_sentence_is_true_when_no_lead_time_can_be_measured() -> None:
    """Issue 37: 'Collapsed runs warned: 3 of 3 … no collapsed run was warned'. Collapsed
    runs whose loss never departed are negatives of low entropy, not warned positives."""
    s = alert_summary(_alert_frame([True] * 3 + [False], [True] * 3 + [False],
                                   [np.nan] * 4, [np.nan] * 4))
    assert (s["positives"], s["negatives"], s["false_alarms"]) == (0, 4, 3)
    assert (s["low_entropy_healthy"], s["low_entropy_healthy_alerted"]) == (3, 3)
    assert warned_sentence(s) == ("no run both collapsed and departed (no positive); 3 runs "
                                  "of low entropy kept a healthy loss (negatives, 3 alerted)")
    # one positive warned late, one unwarned, one collapse whose loss stayed healthy
    frame = _alert_frame([True] * 3, [True, False, True], [20.0, 30.0, np.nan],
                         [-10.0, np.nan, np.nan])
    assert warned_sentence(alert_summary(frame)) == (
        "1 of 2 positives (collapsed, loss departed) warned, 0 of them before their loss "
        "departed (lead -10 to -10 steps, median -10); 1 run of low entropy kept a healthy "
        "loss (negatives, 1 alerted)")
    assert warned_sentence(alert_summary(frame.assign(alerted=[False, False, False]))) == (
        "0 of 2 positives (collapsed, loss departed) warned; 1 run of low entropy kept a "
        "healthy loss (negatives, 0 alerted)")


def _runs_by_hand(cases: dict[str, dict], steps: list[int], warmup: int = 0
                  ) -> StabilityRuns:
    """Runs from ``run_id -> {size, lr, seed, state, metrics: {metric: values at steps},
    val: val losses at steps}`` (one layer; ``diverged_step`` for a diverged run)."""
    runs, layers, vals = [], [], []
    for rid, c in cases.items():
        runs.append({"run_id": rid, "arm": c.get("arm", "none"), "size": c.get("size", "m"),
                     "lr": c["lr"], "seed": c.get("seed", 0), "state": c.get("state", "done"),
                     "steps": steps[-1], "diverged_step": c.get("diverged_step", np.nan),
                     "warmup": c.get("warmup", warmup)})
        for metric, v in c["metrics"].items():
            layers.append(pd.DataFrame({"run_id": rid, "step": steps[:len(v)], "layer": 0,
                                        "metric": metric, "value": v}))
        vals.append(pd.DataFrame({"run_id": rid, "step": steps[:len(c["val"])],
                                  "val_loss": c["val"]}))
    return stability_runs(pd.DataFrame(runs), pd.concat(layers), pd.concat(vals), LEFT_OUT,
                          "hand")


def _low_entropy_healthy_cases() -> dict[str, dict]:
    """Seeds 0 and 1 at the stable lr (healthy); at the high lr seed 0 collapses and its
    loss departs at step 30, seed 1 ends at 0.1 nats with the stable run's loss."""
    steps_val = [4.0, 3.0, 2.8, 2.7, 2.6]
    healthy = {"attn_entropy": [3.0, 2.0, 2.0, 2.0, 2.0],
               "attn_entropy_norm": [0.95, 0.7, 0.65, 0.6, 0.6]}
    return {
        "s0-stable": {"lr": STABLE, "seed": 0, "metrics": healthy, "val": steps_val},
        "s1-stable": {"lr": STABLE, "seed": 1, "metrics": healthy, "val": steps_val},
        "s0-high": {"lr": HIGH, "seed": 0, "val": [4.0, 3.0, 2.8, 2.9, 3.0],
                    "metrics": {"attn_entropy": [3.0, 2.0, 0.5, 0.1, 0.05],
                                "attn_entropy_norm": [0.95, 0.6, 0.2, 0.03, 0.02]}},
        "s1-high": {"lr": HIGH, "seed": 1, "val": [4.0, 3.0, 2.79, 2.69, 2.61],
                    "metrics": {"attn_entropy": [3.0, 2.0, 0.5, 0.2, 0.1],
                                "attn_entropy_norm": [0.95, 0.6, 0.2, 0.06, 0.03]}}}


def test_a_collapse_whose_loss_stays_healthy_is_a_negative_and_its_alert_a_false_alarm(
        ) -> None:
    """The amendment: positive = collapsed and departed. The run at 0.1 nats whose loss
    tracks the stable run's is a negative of low entropy; the entropy rule that fires on
    it makes a false alarm, and a diverged run (a departure at its divergence) is a
    positive."""
    cases = _low_entropy_healthy_cases()
    cases["s1-diverged"] = {"lr": 1e-1, "seed": 1, "state": "diverged", "diverged_step": 20.0,
                            "val": [4.0, 3.0], "metrics": {
                                "attn_entropy": [3.0, 2.0], "attn_entropy_norm": [0.95, 0.6]}}
    stab = _runs_by_hand(cases, [0, 10, 20, 30, 40])
    alerts = evaluate(stab, (entropy_norm_collapse(0.3),)).set_index("run_id")
    assert alerts["collapsed"].to_dict() == {"s0-stable": False, "s1-stable": False,
                                             "s0-high": True, "s1-high": True,
                                             "s1-diverged": True}
    assert alerts["positive"].to_dict() == {"s0-stable": False, "s1-stable": False,
                                            "s0-high": True, "s1-high": False,
                                            "s1-diverged": True}
    assert alerts.loc["s1-diverged", "departure_step"] == 20.0
    s = alert_summary(alerts.reset_index())
    assert (s["negatives"], s["false_alarms"]) == (3, 1)  # s1-high fired at step 20
    assert (s["low_entropy_healthy"], s["low_entropy_healthy_alerted"]) == (1, 1)
    assert (s["positives"], s["positives_warned"], s["warned_before_departure"]) == (2, 1, 1)
    assert s["precision"] == 0.5 and s["recall"] == 0.5
    table = transfer_table([Source(stab)], [("C1", (entropy_norm_collapse(0.3),))])
    row = table[table["cadence"] == "every probe"].iloc[0]
    assert (row["false_alarms"], row["negatives"], row["positives"]) == (1, 3, 2)


def test_a_default_gives_no_false_alarm_on_a_calibration_negative() -> None:
    """C1 (threshold ½ × 0.6) warns the departing collapse 10 steps early, and fires on
    the collapse whose loss stays healthy: a false alarm, so C1 is no default (under the
    protocol-1 count it warned every collapse and would have been)."""
    stab = _runs_by_hand(_low_entropy_healthy_cases(), [0, 10, 20, 30, 40])
    th = calibrate(stab)
    assert th["attn_entropy_norm"] == pytest.approx(0.3)
    c1 = choose_defaults(stab, th).set_index("candidate").loc["C1"]
    assert (c1["positives_warned"], c1["positives"], c1["warned_before_departure"]) == (1, 1, 1)
    assert (c1["false_alarms"], c1["negatives"], c1["low_entropy_healthy_alerted"]) == (1, 3, 1)
    assert not c1["default"]
    # the same runs without the healthy collapse: C1 qualifies
    cases = {k: v for k, v in _low_entropy_healthy_cases().items() if k != "s1-high"}
    ok = choose_defaults(_runs_by_hand(cases, [0, 10, 20, 30, 40]), th).set_index("candidate")
    assert ok.loc["C1", "default"]


def test_when_no_candidate_meets_the_rule_the_fallback_takes_the_earliest_warners() -> None:
    """docs/stability.md#calibration: no candidate warns both positives before their
    departure (step 30); C1 and C2 warn both with no false alarm, C1 one of them early
    (step 20), C2 none: the fallback makes C1 the default, not C2. When C1 warns both early,
    the rule itself chooses it."""
    val_bad = [4.0, 3.0, 2.8, 2.9, 3.0]  # departs from the stable runs' at step 30
    healthy = {"attn_entropy": [3.0, 2.0, 2.0, 2.0, 2.0],
               "attn_entropy_norm": [0.95, 0.7, 0.65, 0.6, 0.6],
               "attn_max": [0.1, 0.3, 0.4, 0.4, 0.4]}
    stable_val = [4.0, 3.0, 2.8, 2.7, 2.6]

    def cases(s1_entropy: list[float]) -> dict[str, dict]:
        return {
            "s0-stable": {"lr": STABLE, "seed": 0, "metrics": healthy, "val": stable_val},
            "s1-stable": {"lr": STABLE, "seed": 1, "metrics": healthy, "val": stable_val},
            "s0-high": {"lr": HIGH, "seed": 0, "val": val_bad, "metrics": {
                "attn_entropy": [3.0, 2.0, 0.5, 0.1, 0.05],
                "attn_entropy_norm": [0.95, 0.6, 0.2, 0.03, 0.02],
                "attn_max": [0.1, 0.4, 0.6, 0.9, 0.95]}},
            "s1-high": {"lr": HIGH, "seed": 1, "val": val_bad, "metrics": {
                "attn_entropy": [3.0, 2.0, 1.5, 0.2, 0.1], "attn_entropy_norm": s1_entropy,
                "attn_max": [0.1, 0.4, 0.5, 0.8, 0.9]}}}

    stab = _runs_by_hand(cases([0.95, 0.6, 0.5, 0.2, 0.03]), [0, 10, 20, 30, 40])
    th = calibrate(stab)
    assert (th["attn_entropy_norm"], th["attn_max"]) == pytest.approx((0.3, 0.7))
    chosen = choose_defaults(stab, th).set_index("candidate")
    assert chosen.loc[["C1", "C2"], "warned_before_departure"].tolist() == [1, 0]
    assert chosen.loc[["C1", "C2"], "positives_warned"].tolist() == [2, 2]
    assert chosen["default"].to_dict() == {c: c == "C1" for c in chosen.index}
    assert chosen.loc["C1", "chosen_by"] == "fallback"
    early = choose_defaults(_runs_by_hand(cases([0.95, 0.6, 0.2, 0.1, 0.03]),
                                          [0, 10, 20, 30, 40]), th).set_index("candidate")
    assert early.loc["C1", "default"] and early.loc["C1", "chosen_by"] == "rule"
    assert not early.loc["C2", "default"]  # the fallback only serves when the rule finds none


# ------------------------------------------------------------------ calibration across sizes


def _series(run_id: str, metric: str, values: list[float]) -> pd.DataFrame:
    return pd.DataFrame({"run_id": run_id, "step": [0, 5, 10][:len(values)], "layer": 0,
                         "metric": metric, "value": values})


def test_thresholds_from_a_calibration_of_two_sizes_equal_hand_values() -> None:
    e = math.e
    hand = {  # (size, lr) -> metric -> values at steps 0, 5, 10
        ("a", STABLE): {"attn_entropy_norm": [0.9, 0.6, 0.5], "attn_max": [0.1, 0.3, 0.4],
                        "logit_max": [1, 2, 4], "logit_bound": [1, e, e]},
        ("b", STABLE): {"attn_entropy_norm": [0.95, 0.7, 0.8], "attn_max": [0.1, 0.5, 0.2],
                        "logit_max": [2, 2, 8], "logit_bound": [2, 2, 2]},
        ("a", HIGH): {"attn_entropy_norm": [0.9, 0.01, 0.01], "attn_max": [0.1, 0.99, 0.99],
                      "logit_max": [1, 500, 900], "logit_bound": [1, 900, 900]}}
    runs, layers, vals = [], [], []
    for (size, lr), metrics in hand.items():
        rid = f"{size}-{lr}"
        runs.append({"run_id": rid, "arm": "none", "size": size, "lr": lr, "seed": 0,
                     "state": "done", "steps": 10, "diverged_step": np.nan})
        for metric, v in {**metrics, "attn_entropy": [3.0, 2.0, 2.0]}.items():
            layers.append(_series(rid, metric, v))
        vals.append(pd.DataFrame({"run_id": rid, "step": [0, 10], "val_loss": [4.0, 2.5]}))
    stab = stability_runs(pd.DataFrame(runs), pd.concat(layers), pd.concat(vals), LEFT_OUT,
                          "cal")
    th = calibrate(stab)
    assert th["attn_entropy_norm"] == pytest.approx(0.25)  # ½ × 0.5 (the high-lr run ignored)
    assert th["attn_max"] == pytest.approx(0.75)  # (1 + 0.5) / 2
    assert th["logit_max_rate"] == pytest.approx(2 * math.log(4) / 5)  # b: 2 -> 8 in 5 steps
    assert th["logit_bound_rate"] == pytest.approx(0.4)  # a: 1 -> e in 5 steps, × 2
    # no warm-up: the rates after it are every rate
    assert th["logit_max_rate_warm"] == th["logit_max_rate"]
    assert th["logit_bound_rate_warm"] == th["logit_bound_rate"]
    rules = candidate_rules(th, 0)
    assert [(r.metric, r.below, r.above, r.rate, r.from_step) for r in rules.values()] == [
        ("attn_entropy_norm", 0.25, None, False, 0), ("attn_max", None, 0.75, False, 0),
        ("logit_max", None, 0.55, True, 0), ("logit_bound", None, 0.4, True, 0),
        ("logit_max", None, 0.55, True, 0), ("logit_bound", None, 0.4, True, 0)]
    assert list(rules) == ["C1", "C2", "C3", "C4", "C3w", "C4w"]
    assert len({r.name for r in rules.values()}) == 6  # C3 and C3w never share a name
    rates = log_rates(stab.layers, "logit_max")
    mine = rates[rates["run_id"] == "b-0.003"]
    assert mine["rate"].tolist() == pytest.approx([0.0, math.log(4) / 5])
    assert mine["prev_step"].tolist() == [0, 5] and mine["step"].tolist() == [5, 10]


def test_c3w_reads_growth_after_the_warmup_only() -> None:
    """A stable run whose max logit grows tenfold in the first 5 steps (inside the warm-up
    of 10) and slowly after; a high-lr run that grows the same early, then fivefold in 5
    steps at step 30, and departs at step 40. C3's R is set by the early growth and stays
    silent on the late one; C3w's R′ ignores the warm-up and fires at step 35."""
    steps = [0, 5, 10, 15, 20, 25, 30, 35, 40]
    early = [1.0, 10.0, 12.0, 13.0, 14.0, 15.0]
    cases = {
        "stable": {"lr": STABLE, "val": [4.0, 3.4, 3.0, 2.9, 2.8, 2.75, 2.7, 2.65, 2.6],
                   "metrics": {"logit_max": [*early, 16.0, 17.0, 18.0],
                               "attn_entropy": [3.0] + [2.0] * 8}},
        "high": {"lr": HIGH, "val": [4.0, 3.4, 3.0, 2.9, 2.8, 2.75, 2.7, 2.68, 3.0],
                 "metrics": {"logit_max": [*early, 16.0, 80.0, 400.0],
                             "attn_entropy": [3.0] + [2.0] * 6 + [0.3, 0.05]}}}
    stab = _runs_by_hand(cases, steps, warmup=10)
    th = calibrate(stab)
    assert th["logit_max_rate"] == pytest.approx(2 * math.log(10) / 5)  # the warm-up's
    assert th["logit_max_rate_warm"] == pytest.approx(2 * math.log(13 / 12) / 5)  # 10 -> 15
    rules = candidate_rules(th, stab.warmup)
    c3, c3w = rules["C3"], rules["C3w"]
    assert (c3w.above, c3w.from_step, c3w.rate) == (0.032, 10, True)
    assert "after the warm-up" in c3w.name and c3w.name != c3.name
    assert evaluate(stab, (c3,))["alerted"].tolist() == [False, False]
    ev = evaluate(stab, (c3w,)).set_index("run_id")
    assert ev["alerted"].to_dict() == {"stable": False, "high": True}
    assert (ev.loc["high", "first_alert_step"], ev.loc["high", "departure_step"]) == (35, 40)
    assert ev.loc["high", "positive"] and ev.loc["high", "lead_steps"] == 5
    chosen = choose_defaults(stab, th).set_index("candidate")
    assert chosen.loc["C3w", "default"] and not chosen.loc["C3", "default"]
    assert chosen.loc["C3w", "from_step"] == 10
    # the table builds C3w per source from the source's own warm-up
    table = transfer_table([Source(stab)], lambda w: rule_sets(th, ["C3w"], w))
    row = table[(table["cadence"] == "every probe")
                & table["rule"].str.startswith("calibrated defaults (C3w)")].iloc[0]
    assert (row["warned_before_departure"], row["positives"], row["false_alarms"]) == (1, 1, 0)


def test_runs_of_different_warmups_are_refused(tmp_path: Path) -> None:
    """One warm-up per source: C3w reads from it. Mixed: one line; trial folders give it
    as trial.warmup_steps or config.warmup_steps."""
    from qkgeom.analysis.stability.report import write_stability_report
    from qkgeom.errors import QKGeomError

    stab = synthetic(2, planted=False, arms=("none",), warmup=20)
    assert stab.warmup == 20
    stab.runs.loc[stab.runs["seed"] == 1, "warmup"] = 50
    with pytest.raises(QKGeomError, match=r"different LR warm-ups \(20, 50 steps\)"):
        calibrate(stab)
    folder = write_stability_sweep(tmp_path / "stability-demo", stab, "stability-demo")
    with pytest.raises(QKGeomError, match="different LR warm-ups"):
        write_stability_report(folder, tmp_path / "report", figures=False)
    trials = synthetic(1, planted=False, sizes=("gpt2",), arms=("none",), warmup=7)
    for where in ("trial", "config"):
        hf = read_trials(write_trial_runs(tmp_path / f"hf-{where}", trials, warmup_in=where))
        assert hf.warmup == 7
    bare = read_trials(write_trial_runs(tmp_path / "hf-none", trials, warmup_in="nowhere"))
    with pytest.raises(QKGeomError, match="records no LR warm-up"):
        _ = bare.warmup


def test_scale_free_candidates_are_chosen_and_transfer_to_a_larger_logit_scale() -> None:
    """Calibrated on sizes with logits at scale 1 and 2, replayed on a size at scale 10:
    the rules in scale-free quantities keep 0 false alarms and warn before departure, the
    absolute logit threshold (protocol 1's) fires on every healthy run."""
    cal = synthetic(3, planted=False, sizes=("a", "b"), scales=(1.0, 2.0), seed=1,
                    arms=("none",))
    th = calibrate(cal)
    chosen = choose_defaults(cal, th).set_index("candidate")
    assert chosen.loc["C1", "default"] and chosen.loc["C2", "default"]
    assert (chosen.loc["C1", "positives_warned"], chosen.loc["C1", "positives"]) == (6, 6)
    held = synthetic(3, planted=True, sizes=("huge",), scales=(10.0,), seed=2)
    defaults = list(chosen.index[chosen["default"]])
    table = transfer_table([Source(cal, in_sample=True), Source(held)],
                           lambda warmup: rule_sets(th, defaults, warmup))
    assert set(table["cadence"]) == {"every probe", "every 4th probe"}
    full = table[(table["cadence"] == "every probe") & (table["model"] == "huge")]
    full = full.set_index("rule")
    defaults = full.loc[[n for n in full.index if n.startswith("calibrated defaults")][0]]
    assert (defaults["false_alarms"], defaults["negatives"]) == (0, 9)
    assert (defaults["warned_before_departure"], defaults["positives"]) == (3, 3)
    old = full.loc["protocol-1 defaults (74 / 8.8 / 0.59)"]
    assert old["false_alarms"] == 9  # healthy logits ~200 at this scale
    lines = requirements(table)
    assert lines[0].startswith("**0 false alarms on negatives at every size and model: met")
    assert "not met" in lines[1] and "huge (synthetic)" in lines[1]  # 1 held-out model of 2


def test_the_alert_table_counts_a_hand_case() -> None:
    """Size a: a stable run that fires (a false alarm), a collapsed run warned 10 steps
    early; size b: a collapsed run never warned. Counts per model, lead times, and the
    sparse cadence that misses the early probe."""
    hand = {("a", STABLE): [0.1, 0.8, 0.2, 0.2, 0.2], ("a", HIGH): [0.1, 0.2, 0.9, 0.95, 0.99],
            ("b", STABLE): [0.1, 0.2, 0.2, 0.2, 0.2], ("b", HIGH): [0.1, 0.2, 0.2, 0.2, 0.2]}
    steps = [0, 10, 20, 30, 40]
    runs, layers, vals = [], [], []
    for (size, lr), peak in hand.items():
        rid = f"{size}-{lr}"
        collapsed = lr == HIGH
        runs.append({"run_id": rid, "arm": "none", "size": size, "lr": lr, "seed": 0,
                     "state": "done", "steps": 40, "diverged_step": np.nan})
        ent = [3.0, 2.0, 2.0, 2.0, 0.1 if collapsed else 2.0]
        for metric, v in (("attn_max", peak), ("attn_entropy", ent)):
            layers.append(pd.DataFrame({"run_id": rid, "step": steps, "layer": 0,
                                        "metric": metric, "value": v}))
        loss = [4.0, 3.0, 2.8, 2.9 if collapsed else 2.7, 3.0 if collapsed else 2.6]
        vals.append(pd.DataFrame({"run_id": rid, "step": steps, "val_loss": loss}))
    stab = stability_runs(pd.DataFrame(runs), pd.concat(layers), pd.concat(vals), LEFT_OUT,
                          "hand")
    assert stab.runs.set_index("run_id")["departure_step"].to_dict() == pytest.approx(
        {"a-0.003": np.nan, "a-0.03": 30.0, "b-0.003": np.nan, "b-0.03": 30.0},
        nan_ok=True)
    table = transfer_table([Source(stab)], [("peak", (attention_peak(0.75),))])
    t = table.set_index(["model", "cadence"])
    a, b = t.loc[("a", "every probe")], t.loc[("b", "every probe")]
    assert (a["false_alarms"], a["negatives"], a["positives_warned"], a["positives"]) == (
        1, 1, 1, 1)
    assert (a["warned_before_departure"], a["lead_median"]) == (1, 10.0)
    assert (b["false_alarms"], b["positives_warned"], b["warned_before_departure"]) == (0, 0, 0)
    sparse_a = t.loc[("a", "every 4th probe")]  # probes 0 and 40 only
    assert (sparse_a["false_alarms"], sparse_a["positives_warned"]) == (0, 1)
    assert (sparse_a["warned_before_departure"], sparse_a["lead_median"]) == (0, -10.0)


# ------------------------------------------------------------------ folders and the report


def test_trial_folders_read_as_runs_of_their_family(tmp_path: Path) -> None:
    stab = synthetic(2, planted=False, sizes=("gpt2", "llama"), arms=("none",))
    trials = read_trials(write_trial_runs(tmp_path / "alerts-hf", stab))
    assert sorted(trials.sizes) == ["gpt2", "llama"] and set(trials.runs["arm"]) == {"none"}
    assert len(trials.runs) == 8 and trials.stable_lr == STABLE
    mine = trials.runs.set_index(["size", "lr", "seed"]).sort_index()
    ref = stab.runs.set_index(["size", "lr", "seed"]).sort_index()
    assert mine["collapsed"].tolist() == ref["collapsed"].tolist()
    assert mine["departure_step"].tolist() == pytest.approx(ref["departure_step"].tolist(),
                                                            nan_ok=True)
    assert (mine["wall_s"] == 12.5).all()


def test_the_transfer_report_finds_its_calibration_and_neighbours(tmp_path: Path) -> None:
    from qkgeom.analysis.stability.report import write_stability_report

    cal = synthetic(3, planted=False, sizes=("4x64-ctx64", "4x128-ctx64"), arms=("none",),
                    lrs=(STABLE, HIGH, 1e-1), seed=3)
    write_stability_sweep(tmp_path / "stability-calibrate", cal, "stability-calibrate")
    held = synthetic(3, planted=False, sizes=("6x192-ctx128",), arms=("none",), seed=4)
    folder = write_stability_sweep(tmp_path / "stability-transfer", held, "stability-transfer")
    write_trial_runs(tmp_path / "alerts-hf", synthetic(2, planted=False, sizes=("gpt2",),
                                                     arms=("none",), seed=5))
    md = write_stability_report(folder, tmp_path / "report", figures=False)
    text = md.read_text()
    assert "## Alerts across sizes" in text and "stability-calibrate" in text
    table = pd.read_csv(tmp_path / "report" / "stability_transfer.csv")
    assert set(table["source"]) == {"stability-calibrate", "stability-transfer", "alerts-hf"}
    assert set(table["model"]) == {"4x64-ctx64", "4x128-ctx64", "6x192-ctx128", "gpt2"}
    assert table.loc[table["source"] == "stability-calibrate", "in_sample"].all()
    assert "**0 false alarms on negatives at every size and model:" in text
    # the calibrate sweep's own report makes the choice
    cal_md = write_stability_report(tmp_path / "stability-calibrate", tmp_path / "cal-report",
                                    figures=False).read_text()
    assert "## Alert calibration\n" in cal_md and "**The default rules: C1, C2" in cal_md


def test_a_sweep_report_has_every_section(tmp_path: Path) -> None:
    from qkgeom.analysis.stability.report import write_stability_report

    stab = synthetic(5, planted=True, lrs=LRS, seed=6)
    folder = write_stability_sweep(tmp_path / "stability-demo", stab, "stability-demo")
    text = write_stability_report(folder, tmp_path / "report", figures=False).read_text()
    for heading in ("## What the runs came to", "## The learning-rate sweep", "## Claims",
                    "## What the seeds could resolve", "## Alerts",
                    "## Alert calibration on these runs", "## Figures"):
        assert heading in text
    assert "## Alerts across sizes" not in text  # no calibration given, not a transfer sweep
    rates = pd.read_csv(tmp_path / "report" / "stability_rates.csv").set_index("arm")
    assert rates.loc["fix", "range_decades"] == pytest.approx(3.0)
    assert rates.loc["none", "range_high"] == STABLE


def test_the_lr_sweep_figure_is_drawn(tmp_path: Path) -> None:
    from qkgeom.analysis.stability.figures import draw_lr_sweep

    png = draw_lr_sweep(synthetic(3, planted=True, lrs=LRS, seed=7), tmp_path)
    assert png.name == "stability_lr_sweep.png" and png.stat().st_size > 10_000
    assert png.with_suffix(".svg").exists()


@pytest.mark.slow
def test_reproduce_stability_smoke_end_to_end(tmp_path: Path) -> None:
    """The CLI trains the smoke grid (every remedy at both learning rates) and reports it:
    the claims, the runs table with every remedy, the alerts, the figures; the terminal
    ends with the labelled summary (none's reference rows, each remedy's S2, S1, S3)."""
    import os
    import subprocess
    import sys

    from qkgeom.experiments.stability import REMEDIES

    out = tmp_path / "stab"
    res = subprocess.run([sys.executable, "-m", "qkgeom.cli", "reproduce", "stability",
                          "--preset", "smoke", "--out", str(out), "--threads", "1"],
                         capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "COLUMNS": "250"})
    assert res.returncode == 0, res.stderr[-2000:]
    rows = _table_rows(res.stdout)
    assert [r[:3] for r in rows[:2]] == [["none", "0.003*", "reference"],
                                         ["none", "0.1", "reference"]]
    labels = {(r[0], r[2]) for r in rows[2:]}
    assert labels == {(arm, label) for arm in REMEDIES if arm != "none" for label in (
        "S2 primary: equivalence ±0.05", "S1 primary", "S3 primary")}
    assert len(rows) == 2 + 3 * (len(REMEDIES) - 1)
    assert "Descriptive: 1 seed" in res.stdout  # one seed: p's, no verdict
    assert any(line.startswith("alerts (qkgeom.alerts.DEFAULT_RULES replayed on every run): "
                               "false alarms on ") for line in res.stdout.splitlines())
    report = out / "report"
    runs = pd.read_csv(report / "stability_runs.csv")
    assert sorted(runs["arm"].unique()) == sorted(REMEDIES)
    assert set(runs["lr"]) == {0.003, 0.1} and len(runs) == 18
    assert runs["acted"].all()
    claims = pd.read_csv(report / "claims.csv")
    assert set(claims["claim_id"]) == {"S1", "S2", "S3"}
    assert len(claims) == 8 * (2 * 3 + 1)
    text = (report / "report.md").read_text()
    for heading in ("## What the runs came to", "## The learning-rate sweep", "## Claims",
                    "## Alerts", "## Alert calibration on these runs", "## Figures"):
        assert heading in text
    assert (report / "stability_lr_sweep.png").stat().st_size > 10_000
    m = pd.read_parquet(out / "runs" / "lr=0.1,seed=0,arm=qk_norm" / "metrics.parquet")
    assert {"logit_max", "logit_delta", "attn_entropy_norm", "attn_max"} <= set(m["metric"])


def test_report_cli_takes_the_calibration_and_other_folders(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    from cli_helpers import in_process

    cal = write_stability_sweep(tmp_path / "cal", synthetic(
        2, planted=False, sizes=("4x64-ctx64",), arms=("none",), seed=8), "stability-calibrate")
    held = write_stability_sweep(tmp_path / "held", synthetic(
        2, planted=False, sizes=("2x96-ctx32",), arms=("none",), seed=9), "my-grid")
    hf = write_trial_runs(tmp_path / "hf", synthetic(2, planted=False, sizes=("llama",),
                                                     arms=("none",), seed=10))
    code, out, err = in_process(["report", str(held), "--calibration", str(cal), "--also",
                                 str(hf), "--out", str(tmp_path / "r")], capsys)
    assert code == 0, err
    table = pd.read_csv(tmp_path / "r" / "stability_transfer.csv")
    assert set(table["source"]) == {"cal", "held", "hf"}
    code, out, err = in_process(["report", str(hf), "--calibration", str(cal)], capsys)
    assert code == 2 and "are for stability sweeps" in err and len(err.strip().splitlines()) == 1


def _table_rows(out: str) -> list[list[str]]:
    """The body rows of a rich table in ``out`` (cells stripped), group cells filled down."""
    rows, last = [], []
    for line in out.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip("│").split("│")]
        if last and not cells[0]:
            cells[0] = last[0]
        rows.append(cells)
        last = cells
    return rows


def test_the_terminal_summary_labels_every_row(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37 item 3: `qkgeom report` of a stability sweep prints per remedy and rate the
    collapsed and diverged counts and Δ val loss with its verdict and one p, S2 labelled as
    the equivalence claim it is, then S3; none's counts as the reference; no secondary
    entropy or max-logit rows; then one line of alerts."""
    from cli_helpers import in_process

    monkeypatch.setenv("COLUMNS", "250")  # one line per row
    stab = synthetic(5, planted=True, lrs=LRS, seed=6)
    folder = write_stability_sweep(tmp_path / "stability-demo", stab, "stability-demo")
    code, out, err = in_process(["report", str(folder), "--out", str(tmp_path / "r")], capsys)
    assert code == 0, err
    rows = {(r[0], r[1]): r[2:] for r in _table_rows(out)}
    assert list(rows) == [("none", lr) for lr in ("0.0003", "0.003*", "0.03", "0.3")] + [
        ("fix", lr) for lr in ("0.0003", "0.003*", "0.03", "0.3", "sweep")]
    assert rows[("none", "0.03")][:3] == ["reference", "5/5", "0/5"]
    assert rows[("none", "0.003*")][:3] == ["reference", "0/5", "0/5"]
    label, collapsed, diverged, delta, verdict = rows[("fix", "0.03")]
    assert (label, collapsed, diverged) == ("S1 primary", "0/5", "0/5")
    assert delta.startswith("-0.30") and verdict == "supported, p 0.031"  # 1/32
    s2 = rows[("fix", "0.003*")]
    assert s2[0] == "S2 primary: equivalence ±0.05"
    assert s2[4].startswith("equivalent to no effect, TOST p ")
    assert rows[("fix", "0.0003")][0] == "low secondary"
    assert ", Holm p " in rows[("fix", "0.0003")][4]
    s3 = rows[("fix", "sweep")]
    assert (s3[0], s3[1], s3[4]) == ("S3 primary", "0/20", "supported, p 0.031")
    assert "final entropy" not in out and "p (Holm)" not in out  # the old claims table
    alerts = [line for line in out.splitlines() if line.startswith("alerts (")]
    assert alerts == ["alerts (qkgeom.alerts.DEFAULT_RULES replayed on every run): false "
                      "alarms on 0 of 30 negatives (loss never departed); 10 of 10 positives "
                      "(collapsed, loss departed) warned, 7 of them before their loss "
                      "departed (lead 0 to 5 steps, median 5); recall 100%"]
    assert "one p per row: S1, S3 the one-sided sign-flip p" in out
    assert "S1/S2/S3/low: 3 of 4 claims supported, 1 equivalent to no effect" in out


def test_the_terminal_summary_of_a_calibration_sweep(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """No remedy: none's counts per size and rate, labelled as no claim, and which
    candidates meet the default rule."""
    from cli_helpers import in_process

    monkeypatch.setenv("COLUMNS", "250")
    cal = synthetic(2, planted=False, sizes=("4x64-ctx64", "4x128-ctx64"), arms=("none",),
                    seed=3, warmup=10)
    folder = write_stability_sweep(tmp_path / "stability-calibrate", cal,
                                   "stability-calibrate")
    code, out, err = in_process(["report", str(folder), "--out", str(tmp_path / "r")], capsys)
    assert code == 0, err
    rows = _table_rows(out)
    assert [(r[0], r[2], r[3], r[4], r[5]) for r in rows] == [
        (size, lr, "no claim (no remedy to compare)", c, "0/2")
        for size in ("4x64-ctx64", "4x128-ctx64") for lr, c in (("0.003*", "0/2"),
                                                                ("0.03", "2/2"))]
    assert any(line.startswith("candidates that meet the default rule on these runs (no "
                               "false alarm on a negative, every positive warned before "
                               "departure): C1") for line in out.splitlines())
