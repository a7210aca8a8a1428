"""E3 on synthetic sweeps with known paired effects: arms, pairing, the manipulation check
(token level, per unit, in the direction of the intended change), the claims (one primary
row each, secondary rows Holm-adjusted, equivalence), the report; and real smoke E3 runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib import image as plt_image
from scipy import stats as sst

from qkgeom.analysis import claims_table, collate, write_report
from qkgeom.analysis.e3 import e3_analysis, is_e3, run_arms
from qkgeom.config import KeyControlConfig

from .conftest import STEPS, monotone_values, write_run, write_sweep
from .synthetic import Run, table_of

SEEDS = range(5)
SHRINK = -0.001  # paired entropy effect per step: shrink lowers it in every seed ...
HOLD = {0: 0.002, 1: 0.002, 2: 0.002, 3: 0.002, 4: -0.002}  # ... hold raises it in 4 of 5
ARMS = {"none": {"mode": "none", "record": True},
        "sham-token-data": {"mode": "sham"},
        "hold-token-data": {"mode": "hold"},
        "shrink-0.5-token-data": {"mode": "shrink", "dose": 0.5},
        "shrink-0.25-token-data": {"mode": "shrink", "dose": 0.25},
        "shrink-0.75-token-data": {"mode": "shrink", "dose": 0.75},
        "shrink-0.5-weight-frobenius": {"mode": "shrink", "dose": 0.5, "level": "weight",
                                        "scale": "frobenius"}}
DEFAULT_ARMS = ("none", "sham-token-data", "hold-token-data", "shrink-0.5-token-data")
ENTROPIES = ("attn_entropy", "attn_entropy_scalefree")


def _dose(step: int, dose: float = 0.5, ramp: int = 20) -> float:
    return 1.0 - (1.0 - dose) * min(step / ramp, 1.0)


def _values(arm: str, seed: int, achieved: float = 0.5, temperature: bool = False):
    """``monotone_values`` + a seed offset; the arm acts on PR_K at both levels (shrink:
    ``achieved`` × none's; hold: its step-0 value) and on both entropies (HOLD per step;
    SHRINK per step at dose 0.5, in proportion to 1 − dose). ``temperature``: the shrink
    effect is on the raw entropy only, through the within-row logit scale (a change of
    temperature), and the scale-free entropy does not move."""
    base = monotone_values()
    mode = ARMS[arm]["mode"]
    shrink = SHRINK * (1.0 - ARMS[arm].get("dose", 1.0)) / 0.5

    def values(layer: int, step: int, metric: str, head: int) -> float:
        v = base(layer, step, metric, head) + 0.01 * seed
        if metric in ("pr_k_weight", "pr_k_token") and step > 0:
            v = {"shrink": achieved * v, "hold": 8.0 + 0.01 * seed}.get(mode, v)
        if metric in ENTROPIES:
            if not (temperature and metric == "attn_entropy_scalefree"):
                v += {"shrink": shrink, "hold": HOLD.get(seed, 0.0)}.get(mode, 0.0) * step
            v += 1e-4 * (-1) ** seed * (mode == "sham")  # the sham: noise around 0
        if metric == "logit_std_row" and temperature and mode == "shrink":
            v -= shrink * step / 0.4  # entropy Δ = −0.4 × within-row scale Δ
        return v

    return values


def _records(arm: str):
    if ARMS[arm]["mode"] not in ("shrink", "sham"):
        return None
    dose = ARMS[arm].get("dose", 1.0)
    return lambda step: {"ctl_dose_l0": _dose(step, dose), "ctl_dose_l1": _dose(step, dose),
                         "ctl_bound_share_l0": 1.0, "ctl_bound_share_l1": 0.9}


def _e3_sweep(root: Path, arms=DEFAULT_ARMS, seeds=SEEDS, achieved: float = 0.5,
              extra: tuple[tuple[str, int, dict], ...] = (), temperature: bool = False) -> Path:
    runs = []
    plan = [(arm, seed, {}) for seed in seeds for arm in arms] + list(extra)
    for arm, seed, cfg in plan:
        rid = f"seed={seed},arm={arm}" + "".join(f",{k}={v}" for k, v in cfg.items())
        loss = {"none": 0.0, "sham": 0.0, "hold": 0.01, "shrink": 0.02}[ARMS[arm]["mode"]]
        write_run(root, rid, 2, "normal", seed, _values(arm, seed, achieved, temperature),
                  extra_cfg={"key_control": ARMS[arm], **cfg}, records=_records(arm),
                  val_loss=lambda s, d=loss: 4.0 - 0.01 * s + d * (s > 0))
        runs.append({"run_id": rid, "axes": {"seed": seed}})
    return write_sweep(root, runs, {"seed": list(seeds)})


def _row(frame: pd.DataFrame, **where) -> pd.Series:
    sel = frame
    for k, v in where.items():
        sel = sel[sel[k] == v]
    assert len(sel) == 1, where
    return sel.iloc[0]


def _primary(claims: pd.DataFrame, claim_id: str) -> pd.Series:
    return _row(claims, claim_id=claim_id, role="primary")


@pytest.fixture(scope="module")
def e3_sweep(tmp_path_factory) -> Path:
    return _e3_sweep(tmp_path_factory.mktemp("e3") / "e3")


def test_arm_names_both_ways():
    for name in ("none", "sham-token-data", "hold-weight-frobenius", "shrink-0.5-token-data",
                 "shrink-0.25-weight-frobenius", "expand-2-token-data"):
        assert KeyControlConfig(**KeyControlConfig.arm_settings(name)).arm == name
    assert KeyControlConfig(mode="shrink", dose=0.5, level="weight").arm == \
        "shrink-0.5-weight-data"
    for bad in ("hold", "shrink-x-token-data", "hold-token", "squash-token-data",
                "hold-0.5-token-data"):
        with pytest.raises(Exception, match="unknown E3 arm"):
            KeyControlConfig.arm_settings(bad)


def test_known_paired_effects_tests_and_verdicts(e3_sweep: Path):
    table = collate(e3_sweep)
    assert is_e3(table)
    a = e3_analysis(table)
    eff, claims = a["effects"], a["claims"]
    early, whole = np.array([10, 20]), np.array(STEPS[1:])  # step 0 left out
    e = _row(eff, arm="shrink-0.5-token-data", baseline="none",
             quantity="attn_entropy_scalefree", window="early")
    assert e["mean"] == pytest.approx(SHRINK * early.mean())
    assert (e["k"], e["n_seeds"]) == (5, 5)
    assert e["p_value"] == pytest.approx(1 / 32) and e["p_sign"] == pytest.approx(1 / 32)
    assert e["p_opposite"] == pytest.approx(1.0)
    assert e["ci_low"] == pytest.approx(e["mean"])  # every seed equal: zero-width interval
    assert e["delta"] == 0.1 and e["p_equiv"] == 0.0  # −0.015 for sure: within ±0.1
    h = _row(eff, arm="hold-token-data", baseline="none", quantity="attn_entropy_scalefree",
             window="whole")
    assert h["mean"] == pytest.approx(0.002 * 3 / 5 * whole.mean())
    assert (h["k"], h["n_seeds"]) == (4, 5)
    # sign-flip: sums of ±w·(1,1,1,1,1) beat 3w only with ≤ 1 minus sign: 6 of 32
    assert h["p_value"] == pytest.approx(6 / 32) and h["p_sign"] == pytest.approx(6 / 32)
    d = 0.002 * whole.mean() * np.array([1, 1, 1, 1, -1])  # each seed's effect, by hand
    tost = max(sst.ttest_1samp(d, -0.1, alternative="greater").pvalue,
               sst.ttest_1samp(d, 0.1, alternative="less").pvalue)
    assert h["p_equiv"] == pytest.approx(tost)
    loss = _row(eff, arm="shrink-0.5-token-data", baseline="none", quantity="val_loss",
                window="whole")
    assert loss["predicted"] == 0 and loss["mean"] == pytest.approx(0.02)
    assert loss["p_value"] == pytest.approx(2 / 32)  # two-sided, no prediction
    # arm − sham of the same level and rule, beside every arm (the sham has no sham row)
    vs = _row(eff, arm="shrink-0.5-token-data", baseline="sham",
              quantity="attn_entropy_scalefree", window="whole")
    assert vs["mean"] == pytest.approx(SHRINK * whole.mean() - 1e-4 * (1 - 1 + 1 - 1 + 1) / 5)
    assert not ((eff["arm"] == "sham-token-data") & (eff["baseline"] == "sham")).any()
    # one primary row per claim, declared: whole run, against none, token level, data rule
    prim = claims[claims["role"] == "primary"]
    assert list(prim["claim_id"]) == ["E3.1", "E3.2", "E3.3", "E3.4", "E3.5"]
    e31 = _primary(claims, "E3.1")
    assert e31["claim"].endswith("(shrink-0.5-token-data)") and e31["origin"] == "whole"
    assert e31["criterion"].startswith("shrink-0.5-token-data − none: scale-free")
    # 5/5 seeds, p = 1/32 at α (no adjustment on a primary row) ...
    assert e31["p_adj"] == e31["p_value"] == pytest.approx(1 / 32)
    # ... but the effect, −0.055 for sure, is inside ±0.1: no effect of interest
    assert e31["verdict"] == "equivalent to no effect"
    assert "within-row logit scale Δ" in e31["beside"] and "vs sham Δ" in e31["beside"]
    assert _primary(claims, "E3.2")["verdict"] == "inconclusive"  # 4/5, p 6/32, wide CI
    # the secondary rows are Holm-adjusted over all of them: 1/32 is not enough there
    sec = claims[claims["role"] == "secondary"]
    fam = int(sec["family"].iloc[0])
    assert fam == int((sec["reason"] == "").sum()) > 5
    early31 = _row(claims, claim_id="E3.1", role="secondary", origin="early",
                   criterion=e31["criterion"].replace("whole", "early"))
    assert early31["p_value"] == pytest.approx(1 / 32)
    assert early31["p_adj"] > early31["p_value"]
    # pr_qk does not differ between arms: all zeros, so no direction and no equivalence
    assert _primary(claims, "E3.3")["verdict"] == "inconclusive"
    e35 = claims[claims["claim_id"] == "E3.5"]
    assert (e35["verdict"] == "not evaluated").all()  # sham (1) and 0.5: two doses
    assert e35["reason"].str.contains("2 dose").all()


def test_a_pure_temperature_effect_is_not_a_sharpening(tmp_path: Path):
    """(a) The shrink arm lowers the raw entropy by −0.4 × its within-row logit-scale
    change and leaves the scale-free entropy alone: the raw-entropy row sees the effect
    (5/5 seeds), the primary (scale-free) row of E3.1 is not supported."""
    a = e3_analysis(collate(_e3_sweep(tmp_path / "temp", temperature=True)))
    raw = _row(a["effects"], arm="shrink-0.5-token-data", baseline="none",
               quantity="attn_entropy", window="whole")
    assert raw["k"] == 5 and raw["p_value"] == pytest.approx(1 / 32) and raw["mean"] < 0
    scale = _row(a["effects"], arm="shrink-0.5-token-data", baseline="none",
                 quantity="logit_std_row", window="whole")
    assert raw["mean"] == pytest.approx(-0.4 * scale["mean"])
    e31 = _primary(a["claims"], "E3.1")
    assert e31["verdict"] != "supported" and e31["mean"] == pytest.approx(0.0, abs=1e-9)
    med = _row(a["mediation"], arm="shrink-0.5-token-data", window="whole")
    assert med["attn_entropy_scalefree_vs_none_mean"] == pytest.approx(0.0, abs=1e-9)
    assert med["attn_entropy_vs_none_mean"] < 0 < med["logit_std_row_vs_none_mean"]


def test_manipulation_per_unit_at_the_token_level(e3_sweep: Path, tmp_path: Path):
    a = e3_analysis(collate(e3_sweep))
    units, man = a["manipulation_units"], a["manipulation"]
    assert set(units["unit"]) == {"l0", "l1"}  # layer scope: one unit per layer
    s = _row(units, arm="shrink-0.5-token-data", seed=0, window="early", unit="l0")
    assert s["achieved"] == pytest.approx(0.5) and s["achieved_weight"] == pytest.approx(0.5)
    assert s["intended"] == pytest.approx((0.75 + 0.5) / 2)  # recorded r(t) at steps 10, 20
    assert s["threshold"] == pytest.approx(np.sqrt(0.625)) and s["passed"]
    assert s["threshold_p1"] == pytest.approx((1 + 0.625) / 2) and s["passed_p1"]
    assert s["bound_share"] == pytest.approx(1.0)
    summary = _row(man, arm="shrink-0.5-token-data", seed=0, window="early")
    assert (summary["units"], summary["checked"], summary["units_passed"]) == (2, 2, 2)
    assert summary["bound_share"] == pytest.approx(0.95) and summary["passed"]
    h = _row(units, arm="hold-token-data", seed=1, window="whole", unit="l1")
    ratio = (8.01 / (8.01 - 0.05 * np.array(STEPS[1:])))
    assert h["achieved"] == pytest.approx(ratio.mean()) and h["passed"]
    assert h["intended"] == pytest.approx(ratio.mean())
    assert _row(man, arm="sham-token-data", seed=0, window="whole")["achieved"] == \
        pytest.approx(1.0)
    # a shrink that leaves the token-level PR_K at 95 % of none's: not evaluated
    weak = e3_analysis(collate(_e3_sweep(tmp_path / "weak", achieved=0.95)))
    e31 = weak["claims"][weak["claims"]["claim_id"] == "E3.1"]
    assert (e31["verdict"] == "not evaluated").all()
    assert e31["reason"].str.contains("manipulation check failed in 5/5 seeds").all()
    assert (weak["claims"].loc[weak["claims"]["claim_id"] == "E3.2", "verdict"]
            != "not evaluated").all()  # the hold arm did what it should


def _hold_pair(root: Path, rising: bool, holds: bool) -> Path:
    """Two layers: the none run's token PR_K goes 60 → 100 (``rising``) or 100 → 60; the
    hold run keeps its step-0 value (``holds``) or moves exactly like none."""
    steps = STEPS[-1]

    def none_k(step: int) -> float:
        frac = step / steps
        return 60.0 + 40.0 * frac if rising else 100.0 - 40.0 * frac

    def values(arm: str):
        def v(layer: int, step: int, metric: str, head: int) -> float:
            if metric in ("pr_k_token", "pr_k_weight"):
                return none_k(0) if (arm == "hold-token-data" and holds) else none_k(step)
            return monotone_values()(layer, step, metric, head)
        return v

    runs = []
    for seed in range(5):
        for arm in ("none", "hold-token-data"):
            rid = f"seed={seed},arm={arm}"
            write_run(root, rid, 2, "normal", seed, values(arm),
                      extra_cfg={"key_control": ARMS[arm]})
            runs.append({"run_id": rid, "axes": {"seed": seed}})
    return write_sweep(root, runs, {"seed": list(range(5))})


@pytest.mark.parametrize("rising", [True, False])
def test_the_hold_gate_points_the_way_the_uncontrolled_pr_k_moved(tmp_path: Path,
                                                                   rising: bool):
    """(b) A hold that keeps PR_K at its step-0 value passes whether the uncontrolled PR_K
    rises (intended ratio < 1) or falls (> 1); a hold that does nothing (ratio 1) fails."""
    for holds in (True, False):
        a = e3_analysis(collate(_hold_pair(tmp_path / f"{rising}-{holds}", rising, holds)))
        units = a["manipulation_units"]
        whole = units[(units["window"] == "whole")]
        assert ((whole["intended"] < 1) == rising).all()
        assert (whole["passed"] == holds).all(), whole[["achieved", "intended", "passed"]]
        gate = a["gate"]
        assert (("hold-token-data", "whole") in gate) == (not holds)
        if not holds:
            assert "check failed in 5/5 seeds" in gate[("hold-token-data", "whole")]


def _hold_at(share: float) -> dict:
    """Five seeds of none and hold (two layers) in memory: the none run's token PR_K is 14
    at step 0 and 1 after (it collapses), so the hold intends 14×; it achieves 14^share."""
    steps = list(range(0, 101, 10))
    t = np.asarray(steps)
    runs = []
    for seed in range(5):
        for arm, later in (("none", 1.0), ("hold-token-data", 14.0 ** share)):
            k = np.tile(np.where(t == 0, 14.0, later), (2, 1))
            ent = np.full((2, len(t)), 2.0) + 0.01 * seed * (arm != "none") * (t > 0)
            runs.append(Run(f"seed={seed},arm={arm}", seed, control=ARMS[arm],
                            pair_key=str(seed),
                            layers={"pr_k_token": k, "pr_k_weight": k, "pr_qk_token": k / 2,
                                    "attn_entropy": ent, "attn_entropy_scalefree": ent}))
    return e3_analysis(table_of(runs, steps, ref_step=25))


def test_the_log_scale_gate_passes_a_hold_at_62_percent_and_fails_one_at_40():
    """Issue 36: the demo's hold reached 62–90 % of its log change and failed the plain-ratio
    gate (a 14× hold had to reach 7.5, 76 %). Halfway on the log scale (√14 = 3.74): 62 %
    passes, 40 % fails; protocol 1's verdicts stay beside (not evaluated at 62 %)."""
    for share, passes in ((0.62, True), (0.40, False)):
        a = _hold_at(share)
        units = a["manipulation_units"]
        whole = units[units["window"] == "whole"]
        assert whole["intended"].to_numpy() == pytest.approx(14.0)
        assert whole["log_share"].to_numpy() == pytest.approx(share)
        assert (whole["passed"] == passes).all() and (whole["passed_p1"] == False).all()  # noqa: E712
        e32 = _primary(a["claims"], "E3.2")
        assert (e32["verdict"] != "not evaluated") == passes, e32["reason"]
        assert e32["verdict_gate_p1"] == "not evaluated"
        man = _row(a["manipulation"], arm="hold-token-data", seed=0, window="whole")
        assert man["passed"] == passes and man["passed_p1"] is False
        assert (man["units_passed"], man["units_passed_p1"]) == (2 * passes, 0)


def test_dose_response_over_the_sham_and_three_shrink_doses(tmp_path: Path):
    """The entropy effect grows with 1 − r in every seed: ρ(effect, r) = +1 per seed."""
    a = e3_analysis(collate(_e3_sweep(tmp_path / "dose", arms=(
        "none", "sham-token-data", "shrink-0.25-token-data", "shrink-0.5-token-data",
        "shrink-0.75-token-data"))))
    e35 = _primary(a["claims"], "E3.5")
    assert (e35["k"], e35["n"]) == (5, 5) and e35["mean"] == pytest.approx(1.0)
    assert e35["verdict"] == "supported" and e35["beside"].startswith("doses 0.25, 0.5, 0.75, 1")
    e31 = a["claims"][(a["claims"]["claim_id"] == "E3.1") & (a["claims"]["origin"] == "whole")
                      & a["claims"]["criterion"].str.contains("scale-free")]
    assert list(e31["claim"].str.extract(r"\((.*)\)")[0]) == [
        "shrink-0.5-token-data", "shrink-0.75-token-data", "shrink-0.25-token-data"]
    assert list(e31["role"]) == ["primary", "secondary", "secondary"]


def test_a_weight_level_arm_is_gated_on_the_token_level(tmp_path: Path):
    """A weight-level shrink halves the weight PR_K but leaves the token-level PR_K of the
    keys at none's: its claims are not evaluated, whatever its entropy did."""
    def values(arm: str, seed: int):
        base = _values(arm, seed)

        def v(layer, step, metric, head):
            if metric == "pr_k_token" and arm != "none":
                return _values("none", seed)(layer, step, metric, head)
            return base(layer, step, metric, head)
        return v

    root = tmp_path / "w"
    runs = []
    for seed in SEEDS:
        for arm in ("none", "shrink-0.5-weight-frobenius"):
            rid = f"seed={seed},arm={arm}"
            write_run(root, rid, 2, "normal", seed, values(arm, seed),
                      extra_cfg={"key_control": ARMS[arm]}, records=_records(arm))
            runs.append({"run_id": rid, "axes": {"seed": seed}})
    a = e3_analysis(collate(write_sweep(root, runs, {"seed": list(SEEDS)})))
    u = a["manipulation_units"]
    assert np.allclose(u["achieved_weight"], 0.5) and np.allclose(u["achieved"], 1.0)
    rows = a["claims"][a["claims"]["claim"].str.contains("weight-frobenius")]
    assert len(rows) and (rows["verdict"] == "not evaluated").all()
    assert _primary(a["claims"], "E3.1")["reason"].startswith("the sweep has no")


def test_pairing_never_crosses_configs_and_excludes_ambiguous_groups(tmp_path: Path):
    """Two none runs per seed that differ in lr pair each with the shrink run of their own
    lr (never cross-paired or pooled); a seed with two identical none runs, and a shrink
    run without a none, are left out with the reason."""
    shrink = "shrink-0.5-token-data"
    extra = (("none", 0, {"lr": 1e-3}), (shrink, 0, {"lr": 1e-3}),
             ("none", 7, {}), ("none", 7, {"eval_every": 50}), (shrink, 7, {}),
             (shrink, 8, {}))
    a = e3_analysis(collate(_e3_sweep(tmp_path / "p", arms=("none", shrink),
                                      seeds=(0, 1), extra=extra)))
    members = a["members"]
    seed0 = members[members["seed"] == 0]
    assert seed0["group"].nunique() == 2
    for _, g in seed0.groupby("group"):
        base = g.loc[g["arm"] == "none", "run_id"].item()
        assert set(g["baseline"]) == {base}
        assert (",lr=" in base) == g["run_id"].str.contains(",lr=").all()
    ex = a["excluded_pairs"].set_index("run_id")["reason"]
    assert ex[f"seed=8,arm={shrink}"].startswith("no uncontrolled (none) run")
    # seed 7's none runs differ only in eval_every, which is part of the config: two groups,
    # one of them without a controlled run (not E3) -> only the plain pair is kept
    assert 7 in set(members["seed"])
    e = a["effects"]
    assert _row(e, arm=shrink, baseline="none", quantity="attn_entropy",
                window="whole")["n_seeds"] == 4  # seeds 0 (two lr), 1 and 7


def test_two_uncontrolled_runs_of_one_config_are_an_ambiguous_baseline(tmp_path: Path):
    root = _e3_sweep(tmp_path / "amb", arms=("none", "shrink-0.5-token-data"), seeds=(0,))
    write_run(root, "seed=0,arm=none,again", 2, "normal", 0, _values("none", 0),
              extra_cfg={"key_control": ARMS["none"]})
    a = e3_analysis(collate(root))
    assert a["members"].empty
    assert a["excluded_pairs"]["reason"].str.contains("ambiguous baseline").all()
    assert (a["claims"]["verdict"] == "not evaluated").all()


def test_an_e1_sweep_is_not_e3(all_rise: Path):
    assert not is_e3(collate(all_rise))
    assert claims_table(all_rise)["claim_id"].iloc[0] == "E1.1"


def test_the_report_follows_the_experiment_the_grid_declares(tmp_path: Path):
    """The declared experiment decides the report: the same paired runs are E3 when the
    grid says ``experiment: e3`` or says nothing, and E1/E2 when it says ``e1``."""
    import json

    ids = {}
    for declared in ("e3", "e1", ""):
        root = _e3_sweep(tmp_path / (declared or "none"), seeds=SEEDS[:2])
        record = json.loads((root / "sweep.json").read_text())
        if declared:
            record["grid"]["experiment"] = declared
        (root / "sweep.json").write_text(json.dumps(record))
        ids[declared] = claims_table(root)["claim_id"].iloc[0]
    assert ids == {"e3": "E3.1", "e1": "E1.1", "": "E3.1"}


def test_e3_report_opens_with_the_manipulation_check(e3_sweep: Path):
    md = write_report(e3_sweep)
    text = md.read_text()
    assert text.startswith("# qkgeom report: e3")
    assert text.index("## Manipulation check") < text.index("## Claims") \
        < text.index("## Power") < text.index("## Mediation") < text.index("## Paired effects")
    assert "| shrink-0.5-token-data | early | 0.500, 0.500, 0.500, 0.500, 0.500 |" in text
    a = e3_analysis(collate(e3_sweep))
    for name in ("manipulation", "manipulation_units", "effects", "mediation", "windows",
                 "arms"):  # the tables
        csv = pd.read_csv(md.parent / f"e3_{name}.csv")
        assert len(csv) == len(a[name]) and list(csv.columns) == list(a[name].columns), name
    man = pd.read_csv(md.parent / "e3_manipulation.csv")
    assert man.loc[(man["arm"] == "shrink-0.5-token-data") & (man["window"] == "early"),
                   "achieved"].tolist() == pytest.approx([0.5] * 5)
    for png in ("e3_trajectories.png", "e3_paired.png"):  # real images with something drawn
        image = plt_image.imread(md.parent / png)
        assert image.shape[0] > 200 and image.shape[1] > 200
        assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 20, png
    page = (md.parent / "report.html").read_text(encoding="utf-8")
    # both figures on the page: small ones embedded, large ones shown from their file
    shown = [png for png in ("e3_trajectories.png", "e3_paired.png") if f'src="{png}"' in page]
    assert page.count('src="data:image/png;base64,') + len(shown) == 2
    assert "shrink-0.5-token-data" in page
    claims = pd.read_csv(md.parent / "claims.csv")
    assert set(claims["claim_id"]) == {"E3.1", "E3.2", "E3.3", "E3.4", "E3.5"}
    assert {"role", "p_sign", "p_equiv", "p_adj", "beside", "reason", "unit"} <= set(
        claims.columns)
    e31 = claims[(claims["claim_id"] == "E3.1") & (claims["role"] == "primary")].iloc[0]
    assert e31["verdict"] == "equivalent to no effect" and e31["p_value"] == pytest.approx(
        1 / 32)


@pytest.mark.slow
def test_real_e3_runs_are_paired_checked_and_reported(sample_data: Path, tmp_path: Path):
    """Four real 20-step runs (2 seeds × none, hold): identical at step 0 within a seed,
    paired by config, the hold checked against what it aimed at, verdicts by the rule."""
    from qkgeom import make_config, train

    out = tmp_path / "e3"
    runs = []
    for seed in (0, 1):
        for mode in ("none", "hold"):
            rid = f"seed={seed},arm={mode}"
            cfg = make_config("smoke", {"data": str(sample_data), "seed": seed, "steps": 20,
                                        "probe_every": 10, "key_control": {"mode": mode}})
            train(cfg, out / "runs" / rid)
            runs.append({"run_id": rid, "axes": {"seed": seed}})
    write_sweep(out, runs)
    data = collate(out)
    assert is_e3(data)
    table = data.metrics
    step0 = table[(table["step"] == 0) & ~table["metric"].str.startswith("ctl_")].pivot_table(
        index=["seed", "layer", "head", "metric"], columns="run_id", values="value")
    for seed in (0, 1):
        cols = [c for c in step0.columns if c.startswith(f"seed={seed},")]
        # same init and data order: every probe metric at step 0 is identical across arms
        assert len(cols) == 2 and (step0.loc[seed, cols].nunique(axis=1) == 1).all()
    a = e3_analysis(data)
    assert sorted(a["members"]["arm"].unique()) == ["hold-token-data", "none"]  # the default
    hold = a["manipulation"].set_index(["window", "seed"])
    assert set(hold.index.get_level_values("window")) == {"whole"}  # 2 seeds x 1 window:
    assert len(hold) == 2 and hold["achieved"].notna().all()  # probes at 0, 10, 20: none
    early = a["claims"][(a["claims"]["origin"] == "early")  # in the early window (step ≤ 5)
                        & a["claims"]["claim_id"].isin(["E3.2", "E3.4"])]
    assert (early["verdict"] == "not evaluated").all()
    md = write_report(out)
    claims = pd.read_csv(md.parent / "claims.csv")
    assert (claims.loc[claims["n"] > 0, "n"] == 2).all()
    # 2 seeds: no sign-flip p below 1/4, so no row is supported, mixed or not supported;
    # a failed or impossible manipulation check leaves it not evaluated
    allowed = {"not evaluated", "inconclusive", "equivalent to no effect"}
    assert set(claims["verdict"]) <= allowed, claims[["claim_id", "verdict"]]
    assert (claims.loc[claims["reason"].fillna("") != "", "verdict"] == "not evaluated").all()
    assert "## Manipulation check" in md.read_text()


def test_pair_keys_ignore_only_the_key_control_and_how_fast_a_run_went(tmp_path):
    root = tmp_path / "pairs"
    write_run(root, "none", 2, "normal", 0, monotone_values(),
              extra_cfg={"key_control": {"mode": "none", "record": True}})
    write_run(root, "shrink", 2, "normal", 0, monotone_values(), extra_cfg={
        "key_control": {"mode": "shrink", "dose": 0.5, "scale": "data"}, "threads": 4})
    write_run(root, "lr", 2, "normal", 0, monotone_values(), lr=1e-3,
              extra_cfg={"key_control": {"mode": "shrink", "dose": 0.5}})
    write_run(root, "seed1", 2, "normal", 1, monotone_values())
    runs = run_arms(collate(root)).set_index("run_id")
    assert runs.loc["none", "pair_key"] == runs.loc["shrink", "pair_key"]
    assert runs.loc["lr", "pair_key"] != runs.loc["none", "pair_key"]
    assert runs.loc["seed1", "pair_key"] != runs.loc["none", "pair_key"]
    assert runs.loc["seed1", "cell_key"] == runs.loc["none", "cell_key"]  # seed left out
    shrink = runs.loc["shrink"]
    assert (shrink["arm"], shrink["mode"], shrink["dose"], shrink["scale"]) == (
        "shrink-0.5-token-data", "shrink", 0.5, "data")
    assert (runs.loc["seed1", "arm"], runs.loc["none", "arm"]) == ("none", "none")


def test_the_manipulation_record_sets_the_controls_records_beside_the_probe():
    """Issue 40: per unit, the control's own PR records (in sample on Σ_ε, without ε, out of
    sample) and the probe's, each ÷ the none run's probe PR_K at the same step. Seed 0
    records all three, seed 1 (a run from before protocol 2) only ``ctl_pr``: n/a."""
    from qkgeom.analysis.e3.report import record_markdown

    steps = list(range(0, 101, 10))
    t = np.asarray(steps, dtype=float)
    none_k = np.where(t == 0, 16.0, 2.0 + t / 10)  # the denominator moves with the step
    runs = []
    for seed in (0, 1):
        extra = {"ctl_pr_l0": np.full(len(t), 16.0), "ctl_pr_l1": np.full(len(t), 16.0)}
        if seed == 0:
            extra |= {"ctl_pr_raw_l0": np.full(len(t), 8.0), "ctl_pr_oos_l0": 2.0 * none_k}
        for arm, k in (("none", none_k), ("hold-token-data", np.where(t == 0, 16.0, 8.0))):
            runs.append(Run(f"seed={seed},arm={arm}", seed, control=ARMS[arm],
                            pair_key=str(seed), extra=extra if arm != "none" else {},
                            layers={"pr_k_token": np.tile(k, (2, 1)),
                                    "pr_k_weight": np.tile(k, (2, 1)),
                                    "pr_qk_token": np.tile(k, (2, 1))}))
    a = e3_analysis(table_of(runs, steps, ref_step=25))
    units = a["manipulation_units"]
    s0 = _row(units, seed=0, unit="l0", window="whole")
    later = none_k[1:]
    assert s0["ctl_ratio"] == pytest.approx(np.mean(16.0 / later))
    assert s0["ctl_raw_ratio"] == pytest.approx(np.mean(8.0 / later))
    assert s0["ctl_oos_ratio"] == pytest.approx(2.0)  # 2 × none's probe, step by step
    assert s0["achieved"] == pytest.approx(np.mean(8.0 / later))
    s1 = _row(units, seed=1, unit="l0", window="whole")
    assert s1["ctl_ratio"] == pytest.approx(np.mean(16.0 / later))
    assert np.isnan(s1["ctl_raw_ratio"]) and np.isnan(s1["ctl_oos_ratio"])
    assert np.isnan(_row(units, seed=0, unit="l1", window="whole")["ctl_raw_ratio"])
    md = record_markdown(units)
    line = next(x for x in md.splitlines() if x.startswith("| hold-token-data | whole | l0 |"))
    assert "| 2.000, n/a |" in line  # out of sample: seed 0, seed 1 not recorded
    summary = _row(a["manipulation"], seed=0, window="whole")
    assert summary["ctl_oos_ratio"] == pytest.approx(2.0)  # l1 has no record: l0's alone


def test_every_e3_summary_shows_the_raw_entropy_beside_the_scale_free_one(e3_sweep: Path,
                                                                          capsys):
    """Protocol 2: the report's opening and the terminal give, for E3.1 and E3.2, the
    raw-entropy reading of the primary row's arm and window beside the scale-free one."""
    from qkgeom.analysis.e3.claims import raw_entropy_lines
    from qkgeom.cli.sweeps import report

    claims = e3_analysis(collate(e3_sweep))["claims"]
    lines = raw_entropy_lines(claims)
    assert [x[:4] for x in lines] == ["E3.1", "E3.2"]
    e31 = _primary(claims, "E3.1")
    raw = _row(claims, claim_id="E3.1", claim=e31["claim"], origin="whole",
               quantity="attn_entropy")
    assert lines[0].startswith("E3.1 (shrink-0.5-token-data − none, whole run): scale-free "
                               f"entropy {e31['estimate'].removeprefix('mean ')} nats "
                               f"(primary: {e31['verdict']}); raw entropy "
                               f"{raw['estimate'].removeprefix('mean ')} nats (secondary: ")
    report(e3_sweep, e3_sweep / "report-cli")
    out = capsys.readouterr().out
    assert lines[0] in out and lines[1] in out
    text = (e3_sweep / "report-cli" / "report.md").read_text()
    head = text[:text.index("## Manipulation check")]
    assert "raw entropy" in head and "scale-free entropy" in head
    csv = pd.read_csv(e3_sweep / "report-cli" / "claims.csv")
    assert {"quantity", "verdict_gate_p1"} <= set(csv.columns)
    assert raw_entropy_lines(csv) == lines  # the terminal reads them back from claims.csv
    assert raw_entropy_lines(csv.drop(columns="quantity")) == []  # not E3's
