"""E3 on synthetic sweeps with known paired effects: arms, pairing, the manipulation check,
the claims, the report; and a real smoke E3 sweep."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib import image as plt_image

from qkgeom.analysis import claims_table, collate, write_report
from qkgeom.analysis.e3 import arm_name, e3_analysis, is_e3

from .conftest import STEPS, monotone_values, write_run, write_sweep

SEEDS = range(5)
SHRINK = -0.001  # paired entropy effect per step: shrink lowers it in every seed ...
HOLD = {0: 0.002, 1: 0.002, 2: 0.002, 3: 0.002, 4: -0.002}  # ... hold raises it in 4 of 5
ARMS = {"none": {"mode": "none", "record": True},
        "sham-data": {"mode": "sham", "scale": "data", "dose": 1.0},
        "hold-data": {"mode": "hold", "scale": "data"},
        "shrink-0.5-data": {"mode": "shrink", "scale": "data", "dose": 0.5},
        "shrink-0.25-data": {"mode": "shrink", "scale": "data", "dose": 0.25},
        "shrink-0.75-data": {"mode": "shrink", "scale": "data", "dose": 0.75}}
DEFAULT_ARMS = ("none", "sham-data", "hold-data", "shrink-0.5-data")


def _dose(step: int, dose: float = 0.5, ramp: int = 20) -> float:
    return 1.0 - (1.0 - dose) * min(step / ramp, 1.0)


def _values(arm: str, seed: int, achieved: float = 0.5):
    """``monotone_values`` + a seed offset; the arm acts on PR_K (shrink: ``achieved`` ×
    none's; hold: its step-0 value) and on the entropy (HOLD per step; SHRINK per step at
    dose 0.5, in proportion to 1 − dose)."""
    base = monotone_values()
    mode = ARMS[arm]["mode"]
    shrink = SHRINK * (1.0 - ARMS[arm].get("dose", 1.0)) / 0.5

    def values(layer: int, step: int, metric: str, head: int) -> float:
        v = base(layer, step, metric, head) + 0.01 * seed
        if metric == "pr_k_weight" and step > 0:
            v = {"shrink": achieved * v, "hold": 8.0 + 0.01 * seed}.get(mode, v)
        if metric == "attn_entropy":
            v += {"shrink": shrink, "hold": HOLD.get(seed, 0.0)}.get(mode, 0.0) * step
            v += 1e-4 * (-1) ** seed * (mode == "sham")  # the sham: noise around 0
        return v

    return values


def _records(arm: str):
    if ARMS[arm]["mode"] not in ("shrink", "sham"):
        return None
    dose = ARMS[arm].get("dose", 1.0)
    return lambda step: {"ctl_dose_l0": _dose(step, dose), "ctl_dose_l1": _dose(step, dose),
                         "ctl_bound_share_l0": 1.0, "ctl_bound_share_l1": 0.9}


def _e3_sweep(root: Path, arms=DEFAULT_ARMS, seeds=SEEDS, achieved: float = 0.5,
              extra: tuple[tuple[str, int, dict], ...] = ()) -> Path:
    runs = []
    plan = [(arm, seed, {}) for seed in seeds for arm in arms] + list(extra)
    for arm, seed, cfg in plan:
        rid = f"seed={seed},arm={arm}" + "".join(f",{k}={v}" for k, v in cfg.items())
        loss = {"none": 0.0, "sham": 0.0, "hold": 0.01, "shrink": 0.02}[ARMS[arm]["mode"]]
        write_run(root, rid, 2, "normal", seed, _values(arm, seed, achieved),
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


@pytest.fixture(scope="module")
def e3_sweep(tmp_path_factory) -> Path:
    return _e3_sweep(tmp_path_factory.mktemp("e3") / "e3")


def test_arm_names():
    assert arm_name("none", 1.0, "data") == "none"
    assert arm_name("sham", 1.0, "frobenius") == "sham-frobenius"
    assert arm_name("hold", 1.0, "data") == "hold-data"
    assert arm_name("shrink", 0.5, "data") == "shrink-0.5-data"
    assert arm_name("shrink", 0.25, "frobenius") == "shrink-0.25-frobenius"


def test_known_paired_effects_tests_and_verdicts(e3_sweep: Path):
    table = collate(e3_sweep)
    assert is_e3(table)
    a = e3_analysis(table)
    eff, claims = a["effects"], a["claims"]
    early, whole = np.array([10, 20]), np.array(STEPS[1:])  # step 0 left out
    e = _row(eff, arm="shrink-0.5-data", baseline="none", quantity="attn_entropy",
             window="early")
    assert e["mean"] == pytest.approx(SHRINK * early.mean())
    assert (e["k"], e["n_seeds"]) == (5, 5)
    assert e["p_value"] == pytest.approx(1 / 32) and e["p_sign"] == pytest.approx(1 / 32)
    assert e["ci_low"] == pytest.approx(e["mean"])  # every seed equal: zero-width interval
    h = _row(eff, arm="hold-data", baseline="none", quantity="attn_entropy", window="whole")
    assert h["mean"] == pytest.approx(0.002 * 3 / 5 * whole.mean())
    assert (h["k"], h["n_seeds"]) == (4, 5)
    # sign-flip: sums of ±w·(1,1,1,1,1) beat 3w only with ≤ 1 minus sign: 6 of 32
    assert h["p_value"] == pytest.approx(6 / 32) and h["p_sign"] == pytest.approx(6 / 32)
    loss = _row(eff, arm="shrink-0.5-data", baseline="none", quantity="val_loss",
                window="whole")
    assert loss["predicted"] == 0 and loss["mean"] == pytest.approx(0.02)
    assert loss["p_value"] == pytest.approx(2 / 32)  # two-sided, no prediction
    # arm − sham of the same scale rule, beside every arm (the sham itself has no sham row)
    vs = _row(eff, arm="shrink-0.5-data", baseline="sham", quantity="attn_entropy",
              window="whole")
    assert vs["mean"] == pytest.approx(SHRINK * whole.mean() - 1e-4 * (1 - 1 + 1 - 1 + 1) / 5)
    assert not ((eff["arm"] == "sham-data") & (eff["baseline"] == "sham")).any()
    e31 = _row(claims, claim_id="E3.1", origin="early")
    assert e31["verdict"] == "supported" and e31["claim"].endswith("(shrink-0.5-data)")
    assert "logit_std Δ" in e31["beside"] and "vs sham Δ" in e31["beside"]
    e32 = _row(claims, claim_id="E3.2", origin="whole")
    assert e32["verdict"] == "mixed" and e32["measured"] == "4/5 seeds (Δ > 0)"
    # pr_qk does not differ between arms: zeros count against the claim
    assert (claims.loc[claims["claim_id"] == "E3.3", "verdict"] == "not supported").all()
    e35 = claims[claims["claim_id"] == "E3.5"]
    assert (e35["verdict"] == "not evaluated").all()  # sham (1) and 0.5: two doses
    assert e35["reason"].str.contains("2 dose").all()


def test_manipulation_table_and_a_control_that_does_not_bind(e3_sweep: Path, tmp_path: Path):
    man = e3_analysis(collate(e3_sweep))["manipulation"]
    s = _row(man, arm="shrink-0.5-data", seed=0, window="early")
    assert s["achieved"] == pytest.approx(0.5)
    assert s["intended"] == pytest.approx((0.75 + 0.5) / 2)  # recorded r(t) at steps 10, 20
    assert s["threshold"] == pytest.approx((1 + 0.625) / 2) and s["passed"]
    assert s["bound_share"] == pytest.approx(0.95)
    h = _row(man, arm="hold-data", seed=1, window="whole")
    ratio = (8.01 / (8.01 - 0.05 * np.array(STEPS[1:])))
    assert h["achieved"] == pytest.approx(ratio.mean()) and h["passed"]
    assert h["intended"] == pytest.approx(ratio.mean())
    assert _row(man, arm="sham-data", seed=0, window="whole")["achieved"] == pytest.approx(1.0)
    # the same sweep with a shrink that leaves PR_K at 95 % of none's: not evaluated
    weak = e3_analysis(collate(_e3_sweep(tmp_path / "weak", achieved=0.95)))
    e31 = weak["claims"][weak["claims"]["claim_id"] == "E3.1"]
    assert (e31["verdict"] == "not evaluated").all()
    assert e31["reason"].str.contains("manipulation check failed in 5/5 seeds").all()
    assert (weak["claims"].loc[weak["claims"]["claim_id"] == "E3.2", "verdict"]
            != "not evaluated").all()  # the hold arm did what it should


def test_dose_response_over_the_sham_and_three_shrink_doses(tmp_path: Path):
    """The entropy effect grows with 1 − r in every seed: ρ(effect, r) = +1 per seed."""
    a = e3_analysis(collate(_e3_sweep(tmp_path / "dose", arms=(
        "none", "sham-data", "shrink-0.25-data", "shrink-0.5-data", "shrink-0.75-data"))))
    e35 = _row(a["claims"], claim_id="E3.5", origin="whole")
    assert (e35["k"], e35["n"]) == (5, 5) and e35["mean"] == pytest.approx(1.0)
    assert e35["verdict"] == "supported" and e35["beside"].startswith("doses 0.25, 0.5, 0.75, 1")
    e31 = a["claims"][(a["claims"]["claim_id"] == "E3.1") & (a["claims"]["origin"] == "whole")]
    assert list(e31["claim"].str.extract(r"\((.*)\)")[0]) == [
        "shrink-0.75-data", "shrink-0.5-data", "shrink-0.25-data"]  # one row per dose


def test_pairing_never_crosses_configs_and_excludes_ambiguous_groups(tmp_path: Path):
    """Two none runs per seed that differ in lr pair each with the shrink run of their own
    lr (never cross-paired or pooled); a seed with two identical none runs, and a shrink
    run without a none, are left out with the reason."""
    extra = (("none", 0, {"lr": 1e-3}), ("shrink-0.5-data", 0, {"lr": 1e-3}),
             ("none", 7, {}), ("none", 7, {"eval_every": 50}), ("shrink-0.5-data", 7, {}),
             ("shrink-0.5-data", 8, {}))
    a = e3_analysis(collate(_e3_sweep(tmp_path / "p", arms=("none", "shrink-0.5-data"),
                                      seeds=(0, 1), extra=extra)))
    members = a["members"]
    seed0 = members[members["seed"] == 0]
    assert seed0["group"].nunique() == 2
    for _, g in seed0.groupby("group"):
        base = g.loc[g["arm"] == "none", "run_id"].item()
        assert set(g["baseline"]) == {base}
        assert (",lr=" in base) == g["run_id"].str.contains(",lr=").all()
    ex = a["excluded_pairs"].set_index("run_id")["reason"]
    assert ex["seed=8,arm=shrink-0.5-data"].startswith("no uncontrolled (none) run")
    # seed 7's none runs differ only in eval_every, which is part of the config: two groups,
    # one of them without a controlled run (not E3) -> only the plain pair is kept
    assert 7 in set(members["seed"])
    e = a["effects"]
    assert _row(e, arm="shrink-0.5-data", baseline="none", quantity="attn_entropy",
                window="whole")["n_seeds"] == 4  # seeds 0 (two lr), 1 and 7


def test_two_uncontrolled_runs_of_one_config_are_an_ambiguous_baseline(tmp_path: Path):
    root = _e3_sweep(tmp_path / "amb", arms=("none", "shrink-0.5-data"), seeds=(0,))
    write_run(root, "seed=0,arm=none,again", 2, "normal", 0, _values("none", 0),
              extra_cfg={"key_control": ARMS["none"]})
    a = e3_analysis(collate(root))
    assert a["members"].empty
    assert a["excluded_pairs"]["reason"].str.contains("ambiguous baseline").all()
    assert (a["claims"]["verdict"] == "not evaluated").all()


def test_an_e1_sweep_is_not_e3(all_rise: Path):
    assert not is_e3(collate(all_rise))
    assert claims_table(all_rise)["claim_id"].iloc[0] == "E1.1"


def test_e3_report_opens_with_the_manipulation_check(e3_sweep: Path):
    md = write_report(e3_sweep)
    text = md.read_text()
    assert text.startswith("# qkgeom report: e3")
    assert text.index("## Manipulation check") < text.index("## Claims") \
        < text.index("## Mediation") < text.index("## Paired effects")
    assert "| shrink-0.5-data | early | 0.500, 0.500, 0.500, 0.500, 0.500 |" in text
    a = e3_analysis(collate(e3_sweep))
    for name in ("manipulation", "effects", "mediation", "windows", "arms"):  # the tables
        csv = pd.read_csv(md.parent / f"e3_{name}.csv")
        assert len(csv) == len(a[name]) and list(csv.columns) == list(a[name].columns), name
    man = pd.read_csv(md.parent / "e3_manipulation.csv")
    assert man.loc[(man["arm"] == "shrink-0.5-data") & (man["window"] == "early"),
                   "achieved"].tolist() == pytest.approx([0.5] * 5)
    for png in ("e3_trajectories.png", "e3_paired.png"):  # real images with something drawn
        image = plt_image.imread(md.parent / png)
        assert image.shape[0] > 200 and image.shape[1] > 200
        assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 20, png
    page = (md.parent / "report.html").read_text(encoding="utf-8")
    # both figures on the page: small ones embedded, large ones shown from their file
    shown = [png for png in ("e3_trajectories.png", "e3_paired.png") if f'src="{png}"' in page]
    assert page.count('src="data:image/png;base64,') + len(shown) == 2
    assert "shrink-0.5-data" in page
    claims = pd.read_csv(md.parent / "claims.csv")
    assert set(claims["claim_id"]) == {"E3.1", "E3.2", "E3.3", "E3.4", "E3.5"}
    assert {"p_sign", "beside", "reason", "unit"} <= set(claims.columns)
    e31 = claims[(claims["claim_id"] == "E3.1") & (claims["origin"] == "early")].iloc[0]
    assert e31["verdict"] == "supported" and e31["p_value"] == pytest.approx(1 / 32)


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
    table = collate(out)
    assert is_e3(table)
    step0 = table[(table["step"] == 0) & ~table["metric"].str.startswith("ctl_")].pivot_table(
        index=["seed", "layer", "head", "metric"], columns="run_id", values="value")
    for seed in (0, 1):
        cols = [c for c in step0.columns if c.startswith(f"seed={seed},")]
        # same init and data order: every probe metric at step 0 is identical across arms
        assert len(cols) == 2 and (step0.loc[seed, cols].nunique(axis=1) == 1).all()
    a = e3_analysis(table)
    assert sorted(a["members"]["arm"].unique()) == ["hold-data", "none"]  # data: the default
    hold = a["manipulation"].set_index(["window", "seed"])
    assert len(hold) == 4 and hold.loc["whole", "achieved"].notna().all()  # 2 seeds x 2 windows
    # probes at 0, 10, 20: none in the early window (step ≤ 5), so nothing to check there
    assert hold.loc["early", "achieved"].isna().all()
    early = a["claims"][(a["claims"]["origin"] == "early")
                        & a["claims"]["claim_id"].isin(["E3.2", "E3.4"])]
    assert (early["verdict"] == "not evaluated").all()
    assert early["reason"].str.contains("manipulation check not possible").all()
    md = write_report(out)
    claims = pd.read_csv(md.parent / "claims.csv")
    assert (claims.loc[claims["n"] > 0, "n"] == 2).all()
    # 2 seeds: p >= 1/4, so nothing can be supported; 2/2 with the sign is mixed, 1/2 or 0/2
    # not supported; a failed or impossible manipulation check leaves it not evaluated
    for r in claims.itertuples():
        expected = ("not evaluated" if isinstance(r.reason, str) and r.reason
                    else {2: "mixed", 1: "not supported", 0: "not supported"}[r.k])
        assert r.verdict == expected, r
    assert "supported" not in set(claims["verdict"])
    assert "## Manipulation check" in md.read_text()
