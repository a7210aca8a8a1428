"""E3 analysis on synthetic sweeps with known paired effects, and a real smoke E3 sweep."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from qkgeom.analysis import claims_table, collate, write_report
from qkgeom.analysis.e3 import e3_analysis, is_e3, paired_differences, seed_bootstrap

from .conftest import STEPS, monotone_values, write_run, write_sweep

SEEDS = range(5)
# Paired entropy effect per step: shrink lowers it in every seed; hold raises it in 4 of 5.
SHRINK = -0.001
HOLD = {0: 0.002, 1: 0.002, 2: 0.002, 3: 0.002, 4: -0.002}


def _values(mode: str, seed: int):
    base = monotone_values()

    def values(layer: int, step: int, metric: str, head: int) -> float:
        v = base(layer, step, metric, head) + 0.01 * seed
        if metric == "attn_entropy":
            v += {"none": 0.0, "shrink": SHRINK, "hold": HOLD.get(seed, 0.0)}[mode] * step
        return v

    return values


def _e3_sweep(root: Path, extra_runs: tuple[tuple[str, int], ...] = ()) -> Path:
    runs = []
    for seed, mode in [*((s, m) for s in SEEDS for m in ("none", "hold", "shrink")),
                       *((s, m) for m, s in extra_runs)]:
        rid = f"seed={seed},key_control={mode}"
        loss = {"none": 0.0, "hold": 0.01, "shrink": 0.02}[mode]
        write_run(root, rid, 2, "normal", seed, _values(mode, seed),
                  extra_cfg={"key_control": mode},
                  val_loss=lambda s, d=loss: 4.0 - 0.01 * s + d * (s > 0))
        runs.append({"run_id": rid, "axes": {"seed": seed, "key_control": mode}})
    return write_sweep(root, runs, {"seed": list(SEEDS), "key_control": ["none", "hold", "shrink"]})


def _row(frame: pd.DataFrame, **where) -> pd.Series:
    sel = frame
    for k, v in where.items():
        sel = sel[sel[k] == v]
    assert len(sel) == 1, where
    return sel.iloc[0]


def test_known_paired_effects_and_verdicts(tmp_path: Path):
    table = collate(_e3_sweep(tmp_path / "e3"))
    assert is_e3(table)
    a = e3_analysis(table, n_boot=500)
    eff, claims = a["effects"], a["claims"]
    # early = probes 10, 20 (≤ 25 % of 100 steps); whole = 10..100 (step 0 left out)
    early_steps, whole_steps = np.array([10, 20]), np.array(STEPS[1:])
    shrink_early = _row(eff, mode="shrink", quantity="attn_entropy", window="early")
    assert shrink_early["mean"] == pytest.approx(SHRINK * early_steps.mean())
    assert (shrink_early["k"], shrink_early["n_seeds"]) == (5, 5)
    assert shrink_early["p_value"] == pytest.approx(1 / 32)
    # every seed has the same effect: the bootstrap CI collapses onto it
    assert shrink_early["ci_low"] == pytest.approx(shrink_early["mean"])
    hold_whole = _row(eff, mode="hold", quantity="attn_entropy", window="whole")
    assert hold_whole["mean"] == pytest.approx(0.002 * 3 / 5 * whole_steps.mean())
    assert (hold_whole["k"], hold_whole["n_seeds"]) == (4, 5)
    assert hold_whole["p_value"] == pytest.approx(6 / 32)
    # val loss: no prediction, two-sided; shrink costs 0.02 nats at every eval after step 0
    loss = _row(eff, mode="shrink", quantity="val_loss", window="whole")
    assert loss["predicted"] == 0 and loss["mean"] == pytest.approx(0.02)
    assert loss["p_value"] == pytest.approx(2 / 32)
    # PR_Q is identical in each pair: a zero effect counts against "Δ > 0"
    assert _row(eff, mode="hold", quantity="pr_q_weight", window="whole")["k"] == 0
    assert list(claims["claim_id"].unique()) == ["E3.1", "E3.2", "E3.3", "E3.4"]
    assert (claims[claims["claim_id"] == "E3.1"]["verdict"] == "supported").all()
    assert _row(claims, claim_id="E3.2", origin="whole")["verdict"] == "mixed"
    assert _row(claims, claim_id="E3.2", origin="whole")["measured"] == "4/5 seeds (Δ > 0)"
    # pr_qk does not differ between modes here: no seed has the predicted sign
    assert (claims[claims["claim_id"] == "E3.3"]["verdict"] == "not supported").all()


def test_unpaired_runs_are_left_out_of_the_pairs(tmp_path: Path):
    table = collate(_e3_sweep(tmp_path / "e3", extra_runs=(("shrink", 7),)))
    paired = paired_differences(e3_analysis(table, n_boot=10)["series"])
    assert 7 not in set(paired["seed"])
    assert sorted(paired["seed"].unique()) == list(SEEDS)


def test_an_e1_sweep_is_not_e3(all_rise: Path):
    assert not is_e3(collate(all_rise))
    assert claims_table(all_rise, n_boot=20)["claim_id"].iloc[0] == "E1.1"


def test_seed_bootstrap_percentiles():
    lo, hi = seed_bootstrap(np.array([1.0, 2.0, 3.0, 4.0, 5.0]), n_boot=4000)
    assert 1.0 < lo < 3.0 < hi < 5.0
    assert np.isnan(seed_bootstrap(np.array([1.0]))[0])


def test_e3_report_files(tmp_path: Path):
    sweep = _e3_sweep(tmp_path / "e3")
    md = write_report(sweep, n_boot=100)
    text = md.read_text()
    assert text.startswith("# qkgeom report: e3")
    first_table = text.split("| id |", 1)[1]
    assert first_table.index("E3.1") < first_table.index("## Paired effects")
    for name in ("claims.csv", "e3_effects.csv", "e3_windows.csv", "e3_paired.csv",
                 "e3_trajectories.png", "e3_paired.png", "report.html"):
        assert (md.parent / name).stat().st_size > 0, name
    claims = pd.read_csv(md.parent / "claims.csv")
    assert set(claims["claim_id"]) == {"E3.1", "E3.2", "E3.3", "E3.4"}


@pytest.mark.slow
def test_real_smoke_e3_sweep_is_paired_and_reported(sample_data: Path, tmp_path: Path):
    from qkgeom.experiments import reproduce_e3

    out = tmp_path / "e3"
    summary = reproduce_e3("smoke", out, str(sample_data), progress=False, workers=2,
                           threads_per_run=1)
    assert summary.counts.get("done") == 6
    table = collate(out)
    step0 = table[table["step"] == 0].pivot_table(
        index=["seed", "layer", "head", "metric"], columns="run_id", values="value")
    for seed in (0, 1):
        cols = [c for c in step0.columns if c.startswith(f"seed={seed},")]
        block = step0.loc[seed, cols]
        # same init and data order: every probe metric at step 0 is identical across modes
        assert len(cols) == 3 and (block.nunique(axis=1) == 1).all()
    later = table[(table["step"] == table["step"].max()) & (table["metric"] == "pr_k_weight")]
    assert later.groupby("run_id")["value"].sum().nunique() == 6  # the control did act
    md = write_report(out, n_boot=200)
    claims = pd.read_csv(md.parent / "claims.csv")
    assert len(claims) == 12 and (claims["n"] == 2).all()
    from qkgeom.analysis.stats import verdict
    for r in claims.itertuples():
        assert r.verdict == verdict(r.k, r.n, r.p_value)
