"""weight_records and records_to_frame: names, layout and hand-known values."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from qkgeom.geometry import (
    LAYER,
    LAYER_ONLY_METRICS,
    METRIC_NAMES,
    WEIGHT_METRICS,
    participation_ratio,
    records_to_frame,
    weight_records,
)


def _as_dict(records):
    out = {}
    for head, metric, value in records:
        assert isinstance(head, int) and isinstance(metric, str) and isinstance(value, float)
        assert (head, metric) not in out, f"duplicate record {(head, metric)}"
        out[(head, metric)] = value
    return out


def _pr_sq_sv(m: torch.Tensor) -> float:
    return float(participation_ratio(torch.linalg.svdvals(m.double()) ** 2))


def test_metric_names_are_the_documented_names() -> None:
    assert METRIC_NAMES == (
        "pr_q_weight",
        "pr_k_weight",
        "contrast_weight",
        "pr_qk_weight",
        "pr_qk_weight_full",
        "pr_q_token",
        "pr_k_token",
        "contrast_token",
        "contrast_token_heads",
        "pr_qk_token",
        "logit_std",
        "attn_entropy",
        "attn_entropy_norm",
        "attn_max",
        "attn_entropy_scalefree",
        "logit_std_row",
        "sink_mass",
        "logit_max",
        "logit_delta",
        "entropy_min",
        "q_norm_max",
        "k_norm_max",
        "logit_bound",
        "pr_q_token_post",
        "pr_k_token_post",
        "contrast_token_post",
    )
    assert LAYER_ONLY_METRICS == ("pr_qk_weight_full", "contrast_token_heads", "entropy_min")


# --- weight_records ----------------------------------------------------------------------


def test_weight_records_match_explicit_svds() -> None:
    n_head, hd, d_model = 3, 4, 16
    g = torch.Generator().manual_seed(0)
    w_q = torch.randn(n_head * hd, d_model, generator=g)  # (d_out, d_model)
    w_k = torch.randn(n_head * hd, d_model, generator=g)  # (d_out, d_model)
    rec = _as_dict(weight_records(w_q, w_k, n_head))
    assert set(rec) == {(h, m) for h in [*range(n_head), LAYER] for m in WEIGHT_METRICS
                        if h == LAYER or m not in LAYER_ONLY_METRICS}
    for h in range(n_head):
        wq_h = w_q[h * hd : (h + 1) * hd].T  # (d_model, hd) = W_Q^h
        wk_h = w_k[h * hd : (h + 1) * hd].T  # (d_model, hd) = W_K^h
        assert rec[(h, "pr_q_weight")] == pytest.approx(_pr_sq_sv(wq_h), rel=1e-10)
        assert rec[(h, "pr_k_weight")] == pytest.approx(_pr_sq_sv(wk_h), rel=1e-10)
        assert rec[(h, "pr_qk_weight")] == pytest.approx(
            _pr_sq_sv(wq_h.double() @ wk_h.double().T), rel=1e-9
        )
    assert rec[(LAYER, "pr_q_weight")] == pytest.approx(_pr_sq_sv(w_q.T), rel=1e-10)
    assert rec[(LAYER, "pr_k_weight")] == pytest.approx(_pr_sq_sv(w_k.T), rel=1e-10)
    # One rule at both levels: the layer's pr_qk is the mean of its heads' ...
    assert rec[(LAYER, "pr_qk_weight")] == pytest.approx(
        sum(rec[(h, "pr_qk_weight")] for h in range(n_head)) / n_head, rel=1e-12
    )
    # ... and the PR of the whole W_Q W_Kᵀ is kept as pr_qk_weight_full.
    assert rec[(LAYER, "pr_qk_weight_full")] == pytest.approx(
        _pr_sq_sv(w_q.T.double() @ w_k.double()), rel=1e-9
    )
    for h in [*range(n_head), LAYER]:
        assert rec[(h, "contrast_weight")] == rec[(h, "pr_q_weight")] - rec[(h, "pr_k_weight")]


def test_weight_records_orthogonal_tied_init() -> None:
    # Orthogonal square W_Q with W_K := W_Q: every head's W_Q^h has orthonormal columns, so
    # PR = hd per head and d_model for the layer; M_h = W W^T is a rank-hd projector.
    torch.manual_seed(0)
    n_head, hd = 4, 4
    w = torch.nn.init.orthogonal_(torch.empty(n_head * hd, n_head * hd))
    rec = _as_dict(weight_records(w, w.clone(), n_head))
    for h in range(n_head):
        for m in ("pr_q_weight", "pr_k_weight", "pr_qk_weight"):
            assert rec[(h, m)] == pytest.approx(hd, rel=1e-5)
        assert rec[(h, "contrast_weight")] == pytest.approx(0.0, abs=1e-5)
    for m in ("pr_q_weight", "pr_k_weight", "pr_qk_weight_full"):
        assert rec[(LAYER, m)] == pytest.approx(n_head * hd, rel=1e-5)
    assert rec[(LAYER, "pr_qk_weight")] == pytest.approx(hd, rel=1e-5)  # the head mean


def test_weight_records_rank_one_key() -> None:
    g = torch.Generator().manual_seed(1)
    w_q = torch.randn(8, 12, generator=g)  # (d_out, d_model), 2 heads of 4
    w_k = torch.randn(8, 1, generator=g) @ torch.randn(1, 12, generator=g)  # rank 1
    rec = _as_dict(weight_records(w_q, w_k, n_head=2))
    for h in (0, 1, LAYER):
        assert rec[(h, "pr_k_weight")] == pytest.approx(1.0, rel=1e-6)
        assert rec[(h, "pr_qk_weight")] == pytest.approx(1.0, rel=1e-6)


# --- records_to_frame --------------------------------------------------------------------


def test_records_to_frame_long_format(tmp_path) -> None:
    recs = {0: [(0, "pr_q_weight", 2.5), (-1, "pr_q_weight", 3.0)], 2: [(1, "attn_max", 0.25)]}
    frame = records_to_frame(recs, run_id="r1", step=100)
    assert list(frame.columns) == ["run_id", "step", "layer", "head", "metric", "value"]
    assert frame["layer"].tolist() == [0, 0, 2]
    assert frame["head"].tolist() == [0, -1, 1]
    assert frame["metric"].tolist() == ["pr_q_weight", "pr_q_weight", "attn_max"]
    assert frame["value"].tolist() == [2.5, 3.0, 0.25]
    assert set(frame["run_id"]) == {"r1"} and set(frame["step"]) == {100}
    assert frame["layer"].dtype == "int64" and frame["value"].dtype == "float64"
    frame.to_parquet(tmp_path / "m.parquet")
    back = pd.read_parquet(tmp_path / "m.parquet")
    assert back["value"].tolist() == frame["value"].tolist()


def test_records_to_frame_empty_and_clash() -> None:
    empty = records_to_frame({}, step=0)
    assert list(empty.columns) == ["step", "layer", "head", "metric", "value"] and len(empty) == 0
    with pytest.raises(ValueError, match="clashes"):
        records_to_frame({0: []}, metric="x")
