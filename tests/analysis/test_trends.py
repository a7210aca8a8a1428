"""Trend statistics on series whose answers are known by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sst

from qkgeom.analysis.e4.claims import e4_claims
from qkgeom.analysis.e4.trends import early_regime, head_correlations, mann_kendall, trend_table


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
    # Kendall's tau-b from scipy agrees in sign and the no-ties case in value
    x = np.array([0.3, 0.1, 0.5, 0.9, 0.4, 1.2, 1.0])
    assert mann_kendall(x)["tau"] == pytest.approx(sst.kendalltau(np.arange(7), x).statistic)


def test_early_regime_and_decay() -> None:
    steps = np.array([0, 1, 2, 4, 8, 16, 32, 64, 128, 256], dtype=float)
    rise_then_fall = np.array([0, 1, 2, 3, 4, 5, 4.5, 3.5, 2.5, 1.5])
    r = early_regime(steps, rise_then_fall)
    assert r["has_regime"] and not r["regime_is_whole_run"]
    assert r["regime_end_step"] == 128.0  # the longest significant prefix
    assert r["suffix_change"] == -1.0 and r["declines"] and not r["decays"]
    late = early_regime(steps, np.array([0, 1, 2, 3, 4, 3, 2, 1, 0, -1.0]))
    assert late["regime_end_step"] == 16.0 and late["decays"] and late["suffix_rho"] == pytest.approx(-1)
    assert early_regime(steps, np.arange(10.0))["regime_is_whole_run"]
    assert not early_regime(steps, -np.arange(10.0))["has_regime"]


def _metrics(series: dict[int, list[float]], steps: list[int]) -> pd.DataFrame:
    rows = []
    for layer, values in series.items():
        for s, v in zip(steps, values, strict=True):
            for metric in ("contrast_token", "contrast_weight"):
                rows.append({"checkpoint": f"step{s}", "step": s, "layer": layer, "head": -1,
                             "metric": metric, "value": v})
            for h in range(4):  # pr_qk rises with entropy across heads
                rows += [{"checkpoint": f"step{s}", "step": s, "layer": layer, "head": h,
                          "metric": m, "value": h + 0.1 * s + (layer if m == "attn_entropy" else 0)}
                         for m in ("pr_qk_token", "pr_qk_weight", "attn_entropy")]
    return pd.DataFrame(rows)


def test_claims_have_computed_verdicts() -> None:
    steps = [0, 1, 2, 4, 8, 16, 32, 64]
    m = _metrics({0: [0, 1, 2, 3, 4, 3, 2, 1], 1: [0, 1, 2, 3, 4, 3.5, 2, 0.5],
                  2: [1, 2, 3, 4, 5, 6, 7, 8]}, steps)
    claims = e4_claims(trend_table(m), head_correlations(m)).set_index(["claim_id", "level"])
    assert claims.loc[("E4.1", "token"), "verdict"] == "supported"  # layer 2 only rises
    assert claims.loc[("E4.1", "token"), "k"] == 1
    assert claims.loc[("E4.2", "token"), "k"] == 3
    assert claims.loc[("E4.3", "token"), "n"] == 2 and claims.loc[("E4.3", "token"), "k"] == 2
    assert claims.loc[("E4.4", "token"), "verdict"] == "supported"
    assert claims.loc[("E4.4", "token"), "n"] == len(steps)
