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

from qkgeom.alerts import AlertRule, attention_peak, logit_growth, replay
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
from qkgeom.analysis.stability.outcomes import read_trials, stability_runs
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
    assert (s["stable_false_alarms"], s["stable_runs"]) == (0, 5)
    assert (s["false_alarms"], s["warned"], s["collapsed_runs"]) == (0, 5, 5)
    assert s["precision"] == 1.0 and s["recall"] == 1.0
    assert (s["departing"], s["warned_before_departure"]) == (5, 5)
    for rid, r in alerts[alerts["collapsed"]].iterrows():
        rows = stab.layers[stab.layers["run_id"] == rid].assign(head=-1)
        first = min(a.step for a in replay(rows.drop(columns="run_id"), rules))
        assert r["first_alert_step"] == first
        assert r["lead_steps"] == r["departure_step"] - first > 0
    noisy = evaluate(stab, (logit_growth(0.0),))  # fires on every probe
    assert alert_summary(noisy)["stable_false_alarms"] == 5
    assert alert_summary(noisy)["precision"] == pytest.approx(5 / 20)


def test_the_warned_sentence_is_true_when_no_lead_time_can_be_measured() -> None:
    """Issue 37: 'Collapsed runs warned: 3 of 3 … no collapsed run was warned'."""
    frame = pd.DataFrame({"collapsed": [True] * 3 + [False], "alerted": [True] * 3 + [False],
                          "departure_step": np.nan, "lead_steps": np.nan,
                          "stable_none": [False] * 3 + [True]})
    s = alert_summary(frame)
    assert (s["warned"], s["departing"], s["warned_before_departure"]) == (3, 0, 0)
    text = warned_sentence(s)
    assert text.startswith("3 of 3 collapsed runs warned")
    assert "no collapsed run's loss departed" in text and "was warned" not in text
    # one departs and is warned late, one departs unwarned: the counts say so
    frame = pd.DataFrame({"collapsed": True, "alerted": [True, False, True],
                          "departure_step": [20.0, 30.0, np.nan],
                          "lead_steps": [-10.0, np.nan, np.nan], "stable_none": False})
    text = warned_sentence(alert_summary(frame))
    assert text == ("2 of 3 collapsed runs warned; 1 of them never departed (no lead time); "
                    "of the 2 that departed, 0 warned before their loss departed (lead -10 to "
                    "-10 steps, median -10)")
    assert warned_sentence(alert_summary(frame.assign(alerted=[False, False, True]))) == (
        "1 of 3 collapsed runs warned; 1 of them never departed (no lead time); none of the "
        "2 that departed was warned")


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
    rules = candidate_rules(th)
    assert [(r.metric, r.below, r.above, r.rate) for r in rules.values()] == [
        ("attn_entropy_norm", 0.25, None, False), ("attn_max", None, 0.75, False),
        ("logit_max", None, 0.55, True), ("logit_bound", None, 0.4, True)]
    rates = log_rates(stab.layers, "logit_max")
    assert rates[rates["run_id"] == "b-0.003"]["rate"].tolist() == pytest.approx(
        [0.0, math.log(4) / 5])


def test_scale_free_candidates_are_chosen_and_transfer_to_a_larger_logit_scale() -> None:
    """Calibrated on sizes with logits at scale 1 and 2, replayed on a size at scale 10:
    the rules in scale-free quantities keep 0 false alarms and warn before departure, the
    absolute logit threshold (protocol 1's) fires on every healthy run."""
    cal = synthetic(3, planted=False, sizes=("a", "b"), scales=(1.0, 2.0), seed=1,
                    arms=("none",))
    th = calibrate(cal)
    chosen = choose_defaults(cal, th).set_index("candidate")
    assert chosen.loc["C1", "default"] and chosen.loc["C2", "default"]
    assert (chosen.loc["C1", "warned"], chosen.loc["C1", "collapsed_runs"]) == (6, 6)
    held = synthetic(3, planted=True, sizes=("huge",), scales=(10.0,), seed=2)
    sets = rule_sets(th, list(chosen.index[chosen["default"]]))
    table = transfer_table([Source(cal, in_sample=True), Source(held)], sets)
    assert set(table["cadence"]) == {"every probe", "every 4th probe"}
    full = table[(table["cadence"] == "every probe") & (table["model"] == "huge")]
    full = full.set_index("rule")
    defaults = full.loc[[n for n in full.index if n.startswith("calibrated defaults")][0]]
    assert (defaults["false_alarms"], defaults["stable_runs"]) == (0, 9)
    assert (defaults["warned_before_departure"], defaults["departing"]) == (3, 3)
    old = full.loc["protocol-1 defaults (74 / 8.8 / 0.59)"]
    assert old["false_alarms"] == 9  # healthy logits ~200 at this scale
    lines = requirements(table)
    assert lines[0].startswith("**0 false alarms on stable runs at every size and model: met")
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
    assert (a["false_alarms"], a["stable_runs"], a["warned"], a["collapsed_runs"]) == (1, 1, 1, 1)
    assert (a["warned_before_departure"], a["departing"], a["lead_median"]) == (1, 1, 10.0)
    assert (b["false_alarms"], b["warned"], b["warned_before_departure"]) == (0, 0, 0)
    sparse_a = t.loc[("a", "every 4th probe")]  # probes 0 and 40 only
    assert (sparse_a["false_alarms"], sparse_a["warned"]) == (0, 1)
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
    assert "**0 false alarms on stable runs at every size and model:" in text
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
    the claims, the runs table with every remedy, the alerts, the figures."""
    import subprocess
    import sys

    from qkgeom.experiments.stability import REMEDIES

    out = tmp_path / "stab"
    res = subprocess.run([sys.executable, "-m", "qkgeom.cli", "reproduce", "stability",
                          "--preset", "smoke", "--out", str(out), "--threads", "1"],
                         capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-2000:]
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
