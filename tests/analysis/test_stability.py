"""The stability analysis on synthetic runs with a planted remedy effect and with none, the
alert replay's false alarms and lead times on recorded trajectories, and the experiment
end to end on real (smoke) runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from qkgeom.alerts import DEFAULT_RULES, AlertRule, entropy_collapse, logit_growth, replay
from qkgeom.analysis.stability.alerts import alert_summary, calibrate, choose_defaults, evaluate
from qkgeom.analysis.stability.claims import stability_claims
from qkgeom.analysis.stability.outcomes import stability_runs

PROBES = np.arange(0, 101, 5)
EVALS = np.arange(0, 101, 10)
STABLE, HIGH = 3e-3, 3e-2


def _trajectory(collapse_at: float | None, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Layer-level entropy, max logit and logit change of 2 layers at PROBES: healthy (entropy
    ~2 nats, max logit ~20), or collapsing from step ``collapse_at`` (entropy to 0.02, max
    logit to 1 000, a jump of the logits)."""
    t = PROBES[None, :].astype(float)
    ent = 3.2 - 1.2 * (1 - np.exp(-t / 20)) + rng.normal(0, 0.05, (2, len(PROBES)))
    top = 0.3 + 20 * (1 - np.exp(-t / 20)) + rng.normal(0, 1, (2, len(PROBES))) ** 2
    if collapse_at is not None:
        on = 1 / (1 + np.exp(-(t - collapse_at) / 2))  # 0 before, 1 after
        ent = ent * (1 - on) + 0.02 * on
        top = top * (1 - on) + 1000 * on
    delta = np.abs(np.diff(top, axis=1, prepend=top[:, :1])) / 10  # a change of the logits
    return {"attn_entropy": ent, "logit_max": top, "logit_delta": delta}


def synthetic(seeds: int, planted: bool, seed: int = 0):
    """Seeds × {stable, high lr} × {none, fix}. At the high lr ``none`` collapses at step
    ~20 and its val loss departs by 0.3 nats; ``fix`` collapses too unless ``planted``.
    At the stable lr both are healthy and their losses differ by noise only."""
    rng = np.random.default_rng(seed)
    runs, layers, vals = [], [], []
    for s in range(seeds):
        base_loss = 2.5 + rng.normal(0, 0.02)
        for lr in (STABLE, HIGH):
            for arm in ("none", "fix"):
                collapses = lr == HIGH and (arm == "none" or not planted)
                rid = f"lr={lr},seed={s},arm={arm}"
                for metric, a in _trajectory(20.0 + rng.normal(0, 1) if collapses else None,
                                             rng).items():
                    for layer in range(2):
                        steps = PROBES if metric != "logit_delta" else PROBES[1:]
                        values = a[layer] if metric != "logit_delta" else a[layer, 1:]
                        layers.append(pd.DataFrame({"run_id": rid, "step": steps,
                                                    "layer": layer, "metric": metric,
                                                    "value": values}))
                loss = base_loss + 3.5 * np.exp(-EVALS / 10) + rng.normal(0, 0.005, len(EVALS))
                if collapses:
                    loss = loss + 0.3 / (1 + np.exp(-(EVALS - 30) / 3))
                vals.append(pd.DataFrame({"run_id": rid, "step": EVALS, "val_loss": loss}))
                runs.append({"run_id": rid, "arm": arm, "lr": lr, "seed": s, "state": "done",
                             "steps": 100, "diverged_step": np.nan})
    return stability_runs(pd.DataFrame(runs), pd.concat(layers, ignore_index=True),
                          pd.concat(vals, ignore_index=True),
                          pd.DataFrame(columns=["run_id", "state", "reason"]), "synthetic")


def _primary(claims: pd.DataFrame, lr: float) -> pd.Series:
    rows = claims[(claims["role"] == "primary") & np.isclose(claims["lr"], lr)]
    assert len(rows) == 1
    return rows.iloc[0]


def test_a_planted_remedy_is_found_and_costs_nothing_at_the_stable_lr() -> None:
    stab = synthetic(6, planted=True)
    runs = stab.runs.set_index("run_id")
    assert runs["collapsed"].groupby([runs["lr"], runs["arm"]]).sum().to_dict() == {
        (STABLE, "fix"): 0, (STABLE, "none"): 0, (HIGH, "fix"): 0, (HIGH, "none"): 6}
    claims = stability_claims(stab)
    s1, s2 = _primary(claims, HIGH), _primary(claims, STABLE)
    assert (s1["claim_id"], s1["verdict"]) == ("S1", "supported")
    assert s1["mean"] == pytest.approx(-0.3, abs=0.02) and s1["k"] == 6
    assert (s2["claim_id"], s2["verdict"]) == ("S2", "equivalent to no effect")
    assert "collapsed: fix 0/6, none 6/6" in s1["beside"]


def test_no_remedy_effect_is_not_called_one() -> None:
    """The remedy arm collapses like none: S1 is not supported (no verdict of an effect in
    any of several null data sets), S2 still equivalent."""
    for seed in range(5):
        claims = stability_claims(synthetic(6, planted=False, seed=seed))
        assert _primary(claims, HIGH)["verdict"] in ("inconclusive", "not supported",
                                                     "equivalent to no effect")
        assert _primary(claims, STABLE)["verdict"] == "equivalent to no effect"


def test_departure_is_the_first_eval_past_the_margin() -> None:
    stab = synthetic(2, planted=True)
    runs = stab.runs.set_index("run_id")
    # +0.3/(1+exp(-(t-30)/3)) > 0.05 (+ noise) first at t = 30 (0.15); at t = 20 it is 0.01
    assert runs.loc["lr=0.03,seed=0,arm=none", "departure_step"] == 30
    assert np.isnan(runs.loc["lr=0.003,seed=0,arm=fix", "departure_step"])


def test_replay_fires_like_the_monitor_once_per_crossing_with_its_step() -> None:
    metrics = pd.DataFrame({"step": [0, 5, 10, 15, 20], "layer": 0, "head": -1,
                            "metric": "logit_max", "value": [1, 80, 60, 90, 95.0]})
    fired = replay(metrics, (logit_growth(74.0),))
    assert [(a.step, a.value) for a in fired] == [(5, 80.0), (15, 90.0)]  # re-armed at 10
    rel = AlertRule("half", "logit_max", below=0.5, relative=True, from_step=10)
    assert [a.step for a in replay(metrics, (rel,))] == []  # baseline 60 at step 10: never < 30


def test_alert_precision_recall_and_lead_time_on_recorded_runs() -> None:
    stab = synthetic(5, planted=True)
    rules = (logit_growth(74.0), entropy_collapse(0.59))
    alerts = evaluate(stab, rules).set_index("run_id")
    s = alert_summary(alerts.reset_index())
    assert (s["stable_false_alarms"], s["stable_runs"]) == (0, 5)
    assert (s["false_alarms"], s["warned"], s["collapsed_runs"]) == (0, 5, 5)
    assert s["precision"] == 1.0 and s["recall"] == 1.0
    for rid, r in alerts[alerts["collapsed"]].iterrows():
        first = min(a.step for a in replay(
            stab.layers[stab.layers["run_id"] == rid].assign(head=-1), rules))
        assert r["first_alert_step"] == first
        assert r["lead_steps"] == r["departure_step"] - first > 0
    # a rule that fires on every probe has no precision left
    noisy = evaluate(stab, (logit_growth(0.0),))
    assert alert_summary(noisy)["stable_false_alarms"] == 5
    assert alert_summary(noisy)["precision"] == pytest.approx(5 / 20)


def test_calibration_reads_the_stable_none_runs_only() -> None:
    stab = synthetic(3, planted=True)
    stable = stab.runs[(stab.runs["arm"] == "none") & (stab.runs["lr"] == STABLE)]["run_id"]
    lay = stab.layers[stab.layers["run_id"].isin(stable)]
    th = calibrate(stab)
    assert th["logit_max"] == 2 * lay[lay["metric"] == "logit_max"]["value"].max()
    ent = lay[(lay["metric"] == "attn_entropy") & (lay["step"] > 0)]["value"]
    assert th["attn_entropy"] == 0.5 * ent.min()
    table = choose_defaults(stab, th).set_index("metric")
    assert table.loc["logit_max", "every_collapse_early"]
    assert not table.loc["pr_k_token", "default"]  # never a default: it needs the run length


def test_the_default_rules_are_the_calibrated_ones() -> None:
    assert [(r.metric, r.above, r.below) for r in DEFAULT_RULES] == [
        ("logit_max", 74.0, None), ("logit_delta", 8.8, None), ("attn_entropy", None, 0.59)]


@pytest.mark.slow
def test_reproduce_stability_smoke_end_to_end(tmp_path: Path) -> None:
    """The CLI trains the smoke grid (every remedy at both learning rates) and reports it:
    the claims, the runs table with every remedy, the alerts, the figure."""
    import subprocess
    import sys

    out = tmp_path / "stab"
    res = subprocess.run([sys.executable, "-m", "qkgeom.cli", "reproduce", "stability",
                          "--preset", "smoke", "--out", str(out), "--threads", "1"],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    report = out / "report"
    runs = pd.read_csv(report / "stability_runs.csv")
    assert sorted(runs["arm"].unique()) == ["entropy_target", "hold", "none", "qk_norm",
                                            "sigma_reparam"]
    assert set(runs["lr"]) == {0.003, 0.1} and len(runs) == 10
    assert runs["acted"].all()
    claims = pd.read_csv(report / "claims.csv")
    assert set(claims["claim_id"]) == {"S1", "S2"} and len(claims) == 4 * 2 * 3
    text = (report / "report.md").read_text()
    for heading in ("## What the runs came to", "## Claims", "## Alerts",
                    "## Alert calibration on these runs", "## Figure"):
        assert heading in text
    assert (report / "stability_trajectories.png").stat().st_size > 10_000
    m = pd.read_parquet(out / "runs" / "lr=0.1,seed=0,arm=qk_norm" / "metrics.parquet")
    assert {"logit_max", "logit_delta"} <= set(m["metric"])
