"""E4: Mann–Kendall, the regime call per layer, the token-block bootstrap, the claims and the
report, on series whose answers are known by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sst

from qkgeom.analysis import claims_table, write_report
from qkgeom.analysis.e4.bootstrap import block_bootstrap
from qkgeom.analysis.e4.claims import e4_claims
from qkgeom.analysis.e4.regime import regime_calls
from qkgeom.analysis.e4.trends import (
    head_correlations,
    mann_kendall,
    mann_kendall_batch,
    trend_table,
)

from .conftest import write_analysis

# A Pythia-like schedule: log-spaced early, then evenly spaced.
STEPS = np.array([0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 2000, 4000, 8000, 16000,
                  32000], dtype=float)
PEAK = 9  # step 256


def rise_then_fall(top: float = 10.0, start: float = 0.0) -> np.ndarray:
    """From ``start`` up to ``top`` at step 256, then down by half the gain at the last
    checkpoint."""
    up = np.linspace(start, top, PEAK + 1)
    down = np.linspace(top, (top + start) / 2, len(STEPS) - PEAK)[1:]
    return np.concatenate([up, down])


def test_mann_kendall_by_hand() -> None:
    mk = mann_kendall([1, 2, 3, 4])  # S = 6, var = 4·3·13/18, Z = 5/√var
    assert mk["s"] == 6 and mk["var_s"] == pytest.approx(26 / 3)
    assert mk["z"] == pytest.approx(5 / np.sqrt(26 / 3))
    assert mk["p_increase"] == pytest.approx(sst.norm.sf(5 / np.sqrt(26 / 3)))
    assert mk["tau"] == 1.0
    ties = mann_kendall([1, 1, 2, 3])  # a tie pair: var −= 2·1·9/18 = 1
    assert ties["s"] == 5 and ties["var_s"] == pytest.approx(26 / 3 - 1)
    assert mann_kendall([3, 2, 1, 0, -1])["p_decrease"] < 0.05
    assert np.isnan(mann_kendall([1, 2])["z"])
    x = np.array([0.3, 0.1, 0.5, 0.9, 0.4, 1.2, 1.0])
    assert mann_kendall(x)["tau"] == pytest.approx(sst.kendalltau(np.arange(7), x).statistic)


def test_batch_mann_kendall_equals_one_series_at_a_time() -> None:
    rng = np.random.default_rng(0)
    x = np.round(rng.normal(size=(6, 9)), 1)  # rounding makes ties
    batch = mann_kendall_batch(x)
    for i, row in enumerate(x):
        one = mann_kendall(row)
        for key in ("s", "var_s", "z", "p_increase"):
            assert batch[key][i] == pytest.approx(one[key])


def _call(values: np.ndarray) -> dict:
    return regime_calls(np.asarray(values, dtype=float)[None, :]).row(0)


def test_a_peak_at_256_that_falls_to_half_is_a_rise_then_fall() -> None:
    """Without noise every drop is beyond noise: the rule sees the fall and the half of the
    gain lost (all 17 checkpoints in the rule: a family without a warm-up)."""
    rc = _call(rise_then_fall(start=2.0))  # 2 -> 10 -> 6: half of the gain of 8 lost
    assert rc["call"] == "rise then fall"
    assert STEPS[rc["peak"]] == 256 and rc["share_lost"] == pytest.approx(0.5)
    assert rc["p_rise"] < 0.05 and rc["p_fall"] < 0.05


def test_a_rise_that_levels_off_is_a_monotone_rise_never_a_regime() -> None:
    flat = np.concatenate([np.arange(5.0), np.full(len(STEPS) - 5, 4.0)])
    rc = _call(flat)
    assert rc["call"] == "monotone rise"  # the old rule: "rise then flat", a regime
    assert STEPS[rc["peak"]] == 8 and rc["share_lost"] == pytest.approx(0.0)
    assert _call(np.arange(len(STEPS), dtype=float))["call"] == "monotone rise"
    assert _call(-np.arange(len(STEPS), dtype=float))["call"] == "fall"
    assert _call(np.zeros(len(STEPS)))["call"] == "no trend"
    assert _call([0.0, 1.0, 2.0])["call"] == "no trend"  # too few checkpoints: no call


def _blocks(series: dict[int, np.ndarray], noise: float, k: int = 8, seed: int = 0
            ) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for layer, values in series.items():
        for b in range(k):
            noisy = values + rng.normal(scale=noise, size=len(values))
            rows += [{"layer": layer, "head": -1, "block": b, "step": s,
                      "metric": "contrast_token_heads", "value": v, "in_trends": True}
                     for s, v in zip(STEPS, noisy, strict=True)]
    return pd.DataFrame(rows)


def test_block_bootstrap_of_a_noisy_rise_then_fall_mostly_agrees() -> None:
    series = {0: rise_then_fall(), 1: np.arange(len(STEPS), dtype=float)}
    blocks = _blocks(series, noise=1.5)
    metrics = blocks.groupby(["layer", "head", "step", "metric"], as_index=False)["value"] \
        .mean().assign(block=-1, in_trends=True)  # all tokens: here the blocks' mean
    per_layer, band = block_bootstrap(metrics, blocks, n_boot=500)
    r0 = per_layer.set_index("layer").loc[0]
    # resamples add a second dose of token noise to the estimate: most, not all, agree
    assert r0["share_rise_then_fall"] > 0.6
    assert r0["share_lost_low"] < 0.5 < r0["share_lost_high"]
    assert r0["peak_step_low"] <= 256 <= r0["peak_step_high"]
    r1 = per_layer.set_index("layer").loc[1]
    assert r1["share_monotone_rise"] > 0.8  # a noisy monotone rise: never a regime
    assert r1["share_rise_then_fall"] < 0.05
    assert len(band) == 2 * len(STEPS) and (band["low"] <= band["high"]).all()
    again, _ = block_bootstrap(metrics, blocks, n_boot=500)
    pd.testing.assert_frame_equal(per_layer, again)  # fixed seed


def _metrics(series: dict[int, np.ndarray], steps: np.ndarray = STEPS,
             head_sign: dict[int, int] | None = None) -> pd.DataFrame:
    """Layer contrasts (every contrast metric the same) and 4 heads per layer whose pr_qk
    and entropy rise together (or, with ``head_sign[layer] = -1``, oppositely)."""
    rows = []
    for layer, values in series.items():
        sign = (head_sign or {}).get(layer, 1)
        for s, v in zip(steps, values, strict=True):
            for metric in ("contrast_token_heads", "contrast_token", "contrast_weight"):
                rows.append({"checkpoint": f"step{int(s)}", "step": s, "layer": layer,
                             "head": -1, "metric": metric, "value": v})
            for h in range(4):
                for m in ("pr_qk_token", "pr_qk_weight", "attn_entropy"):
                    x = h if m != "attn_entropy" else sign * h + layer
                    rows.append({"checkpoint": f"step{int(s)}", "step": s, "layer": layer,
                                 "head": h, "metric": m, "value": x + 0.001 * s})
    return pd.DataFrame(rows)


def test_claims_from_known_calls() -> None:
    m = _metrics({0: rise_then_fall(), 1: rise_then_fall(8.0),
                  2: np.arange(len(STEPS), dtype=float)}, head_sign={2: -1})
    trends = trend_table(m)
    claims = e4_claims(trends, head_correlations(m)).set_index(["claim_id", "level"])
    e41 = claims.loc[("E4.1", "token_heads")]
    # one model, one unit: decided by its own Šidák p; the layers counted beside
    assert (e41["k"], e41["n"], e41["verdict"]) == (1, 1, "supported")
    assert e41["measured"] == "2/3 layers fall" and e41["role"] == "primary"
    assert "2 rise then fall, 1 monotone rise" in e41["estimate"]  # layer 2 only rises
    e42 = claims.loc[("E4.2", "token_heads")]
    assert e42["measured"] == "2/3 layers rise then fall" and e42["verdict"] == "supported"
    e43 = claims.loc[("E4.3", "token_heads")]
    assert e43["n"] == 3 and "0.50" in e43["estimate"]  # the share lost of layers 0 and 1
    e44 = claims.loc[("E4.4", "token")]
    assert (e44["k"], e44["n"]) == (2, 3)  # per layer at the last checkpoint, never pooled
    assert "pooled" in e44["beside"]
    assert list(claims.reset_index()["level"].unique()[:3]) == ["token_heads", "token",
                                                                 "weight"]


def test_an_older_folder_without_the_head_mean_contrast_is_not_evaluated_on_it() -> None:
    m = _metrics({0: rise_then_fall()})
    m = m[m["metric"] != "contrast_token_heads"]
    claims = e4_claims(trend_table(m), head_correlations(m))
    primary = claims[claims["level"] == "token_heads"]
    assert len(primary) == 3 and (primary["verdict"] == "not evaluated").all()
    assert primary["reason"].str.contains("no contrast_token_heads recorded").all()
    assert (claims.loc[claims["level"] == "token", "verdict"] != "not evaluated").all()


def _analysis_folder(root: Path, series: dict[int, np.ndarray], blocks: bool) -> Path:
    """An analysis folder as ``qkgeom analyze`` writes it, with per-block rows."""
    m = _metrics(series).assign(run_id="tiny", block=-1, in_trends=True, duplicate_of=None)
    if blocks:
        b = _blocks(series, noise=1.0).assign(run_id="tiny", duplicate_of=None)
        b["checkpoint"] = "step" + b["step"].astype(int).astype(str)
        m = pd.concat([m, b[m.columns]], ignore_index=True)
    return write_analysis(root, m, [f"step{int(s)}" for s in STEPS], STEPS.astype(int))


def test_e4_report_with_blocks(tmp_path: Path) -> None:
    folder = _analysis_folder(tmp_path / "an", {0: rise_then_fall(),
                                                1: np.arange(len(STEPS), dtype=float)}, True)
    md = write_report(folder, n_boot=200)
    text = md.read_text()
    assert text.index("## Claims") < text.index("## Setup") < text.index("## Contrast regime")
    assert "not independent" in text and "200 resamples of the 8 token blocks" in text
    assert "**rise then fall**" in text and "**monotone rise**" in text
    assert "not recorded for this family" in text  # no warm-up: every checkpoint in the rule
    boot = pd.read_csv(md.parent / "bootstrap.csv")
    assert list(boot["layer"]) == [0, 1] and (boot["n_boot"] == 200).all()
    for png in ("contrast_steps.png", "prefix_trend.png", "qk_entropy_heads.png"):
        assert (md.parent / png).stat().st_size > 1000
    claims = claims_table(folder, n_boot=200)
    assert claims.loc[claims["claim_id"] == "E4.1", "verdict"].iloc[0] == "supported"
    assert "block bootstrap" in claims.loc[claims["claim_id"] == "E4.2", "beside"].iloc[0]
    # layer 0 rises then falls in most resamples: some layer falls
    assert boot["share_any_fall"].iloc[0] >= boot.loc[0, "share_rise_then_fall"]


def test_e4_report_without_blocks_says_so(tmp_path: Path) -> None:
    folder = _analysis_folder(tmp_path / "an", {0: rise_then_fall()}, False)
    text = write_report(folder, figures=False).read_text()
    assert "No token blocks are recorded" in text


def test_the_layer_table_of_an_analysis_folder_is_of_all_tokens() -> None:
    from qkgeom.analysis.tables import layer_table

    m = _metrics({0: rise_then_fall()}).assign(block=-1)
    blocks = _blocks({0: rise_then_fall() + 100.0}, noise=0.0).assign(
        checkpoint=lambda f: "step" + f["step"].astype(int).astype(str),
        metric="contrast_token")
    step, table = layer_table(pd.concat([m, blocks[m.columns]], ignore_index=True))
    assert step == STEPS[-1]
    assert table.loc[0, "contrast tok"] == pytest.approx(rise_then_fall()[-1])  # not + 100
