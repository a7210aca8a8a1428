"""The width ladder (docs/protocols.md#the-width-ladder): settings found from the runs,
each setting's claims from its own runs, the trend test over seeds (slope on log₂ width,
two-sided sign-flip, Holm over the six), arms against their rung, and the report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from qkgeom.analysis import collate, stats, write_report
from qkgeom.analysis.e1 import ladder as lad
from qkgeom.analysis.e1.report import e1_claims
from qkgeom.analysis.report import summary_line

from .conftest import monotone_values, write_run, write_sweep
from .e1_sweeps import own_fluctuation, with_pr_k_moved

WIDTHS = (64, 128, 256)
SEEDS = tuple(range(8))
N_NULL = 200
BOUND = 0.05 + 3 * np.sqrt(0.05 * 0.95 / N_NULL)


def test_seed_slopes_by_hand():
    values = pd.DataFrame({64: [1.0, 0.0, 5.0, np.nan], 128: [2.0, np.nan, 1.0, 3.0],
                           256: [5.0, 4.0, 1.0, np.nan]}, index=[0, 1, 2, 3])
    slopes = lad.seed_slopes(values)
    # x = log2 width = 6, 7, 8: the OLS slope is (y256 − y64)/2 whatever the middle rung
    assert slopes[0] == pytest.approx(2.0)
    assert slopes[1] == pytest.approx(2.0)  # the middle rung missing: two rungs suffice
    assert slopes[2] == pytest.approx(-2.0)
    assert np.isnan(slopes[3])  # one rung: no slope


def _effects(values: np.ndarray, widths=WIDTHS) -> pd.DataFrame:
    """Seed effects as :func:`ladder.seed_effects` gives them: ``values`` (claims, seeds,
    widths), the claims in :data:`ladder.ORDER`."""
    rows = []
    for c, claim_id in enumerate(lad.ORDER):
        stat = lad.primary_statistic(claim_id)[0]
        for s in range(values.shape[1]):
            for w, width in enumerate(widths):
                rows.append({"setting": f"width {width}", "width": width, "rung": True,
                             "seed": s, "run_id": f"s{s}w{width}", "claim_id": claim_id,
                             "statistic": stat, "value": values[c, s, w]})
    return pd.DataFrame(rows)


def test_a_planted_slope_moves_with_width_and_a_flat_ladder_does_not():
    rng = np.random.default_rng(3)
    x = np.log2(WIDTHS)
    values = rng.normal(0.0, 0.3, size=(6, 8, 3))
    values[0] += -0.8 * (x - x.mean())  # E1.2: ΔPR_K falls 0.8 per doubling (toward)
    values[1] += 0.8 * (x - x.mean())  # E1.1: ΔPR_Q rises (toward)
    values[3] += -0.8 * (x - x.mean())  # E2.1: falls (away: E2.1 predicts > 0)
    trend = lad.trend_rows(_effects(values)).set_index("claim_id")
    assert list(trend.index) == list(lad.ORDER)
    for cid, direction in (("E1.2", "toward the claim"), ("E1.1", "toward the claim"),
                           ("E2.1", "away from the claim")):
        assert trend.loc[cid, "verdict"] == lad.MOVES and trend.loc[cid, "direction"] == direction
        assert (trend.loc[cid, "k_up"], trend.loc[cid, "n"]) in ((0, 8), (8, 8))
        assert trend.loc[cid, "p_value"] == pytest.approx(2 / 256)  # every seed agrees
        assert trend.loc[cid, "p_adj"] == pytest.approx(6 * 2 / 256)  # Holm over six
    assert abs(trend.loc["E1.2", "mean_slope"] + 0.8) < 0.3
    assert set(trend.loc[["E1.3", "E2.2", "E2.3"], "verdict"]) == {lad.NO_TREND}
    assert "64: " in trend.loc["E1.2", "width_means"]


def test_flat_ladders_move_with_width_at_most_at_the_nominal_share():
    """200 null ladders (8 seeds, 3 widths, a seed's effect shared across its widths plus
    skewed noise): every claim's trend row, and any of the six, says *moves with width* in
    at most 0.05 + 3 SE of them (Holm keeps the six together at the nominal level)."""
    rng = np.random.default_rng(4)
    seed_part = rng.normal(0.0, 1.0, size=(N_NULL, 6, 8, 1))
    noise = rng.gamma(2.0, 0.3, size=(N_NULL, 6, 8, 3)) * rng.choice([-1, 1], (N_NULL, 6, 8, 3))
    moves = np.array([
        (lad.trend_table({cid: pd.DataFrame(v[c], columns=list(WIDTHS))
                          for c, cid in enumerate(lad.ORDER)})["verdict"] == lad.MOVES)
        .to_numpy() for v in seed_part + noise])  # (ladders, claims)
    assert (moves.mean(axis=0) <= BOUND).all(), moves.mean(axis=0)
    assert moves.any(axis=1).mean() <= BOUND


def test_fewer_than_two_widths_is_no_ladder(tmp_path: Path):
    root = _ladder(tmp_path / "one", widths=(128,), arm=False, seeds=(0, 1))
    assert lad.ladder_settings(collate(root)).empty


def _ladder(root: Path, widths=WIDTHS, seeds=SEEDS, arm: bool = True,
            slope_k: float = -1.0, arm_k: float = -0.5) -> Path:
    """A ladder on disk: depth 2, 3 heads; per width and seed a run whose ΔPR_K from the
    reference (step 30) is −3.5 + ``slope_k``·log₂(width/128) + a seed's own noise (and
    ``arm_k`` more in the arm: width 128 at batch 32 × context 128); every run has its own
    fluctuation, so E2's null has something to tell apart."""
    rng = np.random.default_rng(11)
    settings = [(w, 16, 64) for w in widths] + ([(128, 32, 128)] if arm else [])
    runs = []
    for seed in seeds:
        noise = rng.normal(0.0, 0.1)
        for i, (width, batch, context) in enumerate(settings):
            shift = slope_k * np.log2(width / 128) + noise + (arm_k if batch == 32 else 0.0)
            values = with_pr_k_moved(own_fluctuation(monotone_values(wiggle=0.3),
                                                     1.1 * seed + 2.9 * i, size=0.05),
                                     lambda step, c=shift: c * max(0, step - 30) / 70)
            rid = f"seed={seed},w={width},b={batch}"
            write_run(root, rid, 2, "normal", seed, values, extra_cfg={
                "model": {"n_layer": 2, "n_head": 3, "n_embd": width, "block_size": context,
                          "vocab_size": 50, "qk_init": "normal", "bias": False,
                          "dropout": 0.0}, "batch_size": batch})
            runs.append({"run_id": rid, "axes": {"seed": seed}})
    # a run the sweep lists but has not started: left out (and the runs table's whole
    # numbers become floats, which must not split a setting from its rows)
    runs.append({"run_id": "seed=99,w=64,b=16", "axes": {"seed": 99}})
    return write_sweep(root, runs, {"seed": [*seeds, 99]})


@pytest.fixture(scope="module")
def ladder_folder(tmp_path_factory) -> Path:
    return _ladder(tmp_path_factory.mktemp("ladder") / "e1-ladder")


def test_a_ladder_sweep_is_read_setting_by_setting(ladder_folder: Path):
    data = collate(ladder_folder)
    assert list(data.excluded["run_id"]) == ["seed=99,w=64,b=16"]
    assert data.runs["depth"].dtype == float
    settings = lad.ladder_settings(data)
    assert list(settings["setting"]) == ["width 64", "width 128", "width 256",
                                         "width 128, 32 × 128"]
    assert list(settings["rung"]) == [True, True, True, False]
    assert (settings["runs"] == 8).all()
    e1 = e1_claims(data)
    claims = e1["claims"]
    assert set(claims["setting"]) == set(settings["setting"])
    prim = claims[claims["role"] == "primary"]
    assert len(prim) == 4 * 6 and (prim["n"] == 8).all()  # each setting: its own 8 runs
    assert (prim.groupby("setting")["family"].first() == 6).all()  # Holm within a setting
    e12 = prim[prim["claim_id"] == "E1.2"].set_index("setting")["mean"]
    assert e12["width 256"] - e12["width 64"] == pytest.approx(-2.0, abs=0.05)
    trend = e1["trend"].set_index("claim_id")
    assert trend.loc["E1.2", "verdict"] == lad.MOVES
    assert trend.loc["E1.2", "direction"] == "toward the claim"
    assert trend.loc["E1.2", "mean_slope"] == pytest.approx(-1.0, abs=0.05)
    assert trend.loc["E1.1", "verdict"] == lad.NO_TREND  # ΔPR_Q is the same at every width
    arms = e1["arms"].set_index("claim_id")
    assert arms.loc["E1.2", "setting"] == "width 128, 32 × 128"
    assert arms.loc["E1.2", "rung_setting"] == "width 128"
    assert arms.loc["E1.2", "mean"] == pytest.approx(-0.5, abs=0.05)
    assert (arms.loc["E1.2", "k_up"], arms.loc["E1.2", "n"]) == (0, 8)
    by_width = lad.e12_by_width(e1["seed_effects"])
    assert list(by_width.columns) == ["width", "seed", "effect"] and len(by_width) == 24
    assert set(by_width["width"]) == set(WIDTHS)
    # readings and reference sensitivity are per setting too, never pooled across widths
    assert set(e1["readings"]["setting"]) == set(settings["setting"])
    assert e1["sensitivity"]["variant"].nunique() == 4


def test_the_ladder_report(ladder_folder: Path, tmp_path: Path):
    md = write_report(ladder_folder, tmp_path / "report", figures=False)
    text = md.read_text(encoding="utf-8")
    first = text.splitlines()[2]
    # ΔPR_K moves with width, and with it the contrast PR_Q − PR_K (E1.3)
    assert first.startswith("> **E1/E2 width ladder: 2 of 6 primary effects move with "
                            "width (E1.2 toward the claim, E1.3 toward the claim); width 64: ")
    assert summary_line(md.parent) == first.strip("> *")
    assert text.index("## Verdict by width") < text.index("## Trend with width") \
        < text.index("## Arms against their rung") < text.index("## Claims at width 64")
    verdicts = text.split("## Verdict by width", 1)[1].split("##", 1)[0]
    assert "| claim | width 64 | width 128 | width 256 | trend with width | width 128, 32 × " \
           "128 |" in verdicts
    assert "moves with width (toward the claim), p (Holm) 0.047" in verdicts
    for name in ("ladder_settings", "ladder_trend", "ladder_seed_effects", "ladder_arms",
                 "claims", "reference_sensitivity"):
        assert len(pd.read_csv(md.parent / f"{name}.csv")), name
    from qkgeom.analysis.e1.figures import fig_ladder
    from qkgeom.analysis.figstyle import save_figure

    from .test_report import assert_figure

    effects = pd.read_csv(md.parent / "ladder_seed_effects.csv")
    trend = pd.read_csv(md.parent / "ladder_trend.csv", keep_default_na=False,
                        na_values=[""])
    assert_figure(save_figure(fig_ladder(effects, trend), tmp_path, "ladder")[0])


def test_e3_by_width_and_the_width_figure(tmp_path: Path):
    from qkgeom.analysis.e1.figures import fig_width_effects
    from qkgeom.analysis.figstyle import save_figure

    windows = pd.DataFrame({
        "group": "g", "seed": [0, 1, 0, 1, 0], "arm": ["shrink-0.5-token-data"] * 2
        + ["hold-token-data"] * 2 + ["shrink-0.5-token-data"], "baseline": "none",
        "quantity": ["attn_entropy_scalefree"] * 4 + ["attn_entropy"], "window": "whole",
        "mean_diff": [-0.1, -0.2, 0.3, 0.4, -9.0]})
    e3 = lad.e3_by_width(windows, 64)
    assert e3.to_dict("list") == {"width": [64, 64], "seed": [0, 1], "effect": [-0.1, -0.2]}
    with pytest.raises(ValueError, match="e3_windows.csv"):
        lad.e3_by_width(windows.drop(columns="mean_diff"), 64)
    e1 = pd.DataFrame({"width": [64, 64, 128, 128], "seed": [0, 1, 0, 1],
                       "effect": [-1.0, -0.5, 0.5, 1.0]})
    fig = fig_width_effects(e1, pd.concat([e3, e3.assign(width=128)]))
    png = save_figure(fig, tmp_path, "width_effects")[0]
    from .test_report import assert_figure

    assert_figure(png)
    assert stats.finite(e1["effect"]).size == 4
