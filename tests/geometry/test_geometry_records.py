"""weight_records, TokenGeometry and records_to_frame: names, layout and hand-known values."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from qkgeom.geometry import (
    LAYER,
    METRIC_NAMES,
    TOKEN_METRICS,
    WEIGHT_METRICS,
    AttentionStats,
    TokenGeometry,
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


def test_metric_names_are_the_spec_names() -> None:
    assert METRIC_NAMES == (
        "pr_q_weight",
        "pr_k_weight",
        "contrast_weight",
        "pr_qk_weight",
        "pr_q_token",
        "pr_k_token",
        "contrast_token",
        "pr_qk_token",
        "attn_entropy",
        "attn_entropy_norm",
        "attn_max",
    )


# --- weight_records ----------------------------------------------------------------------


def test_weight_records_match_explicit_svds() -> None:
    n_head, hd, d_model = 3, 4, 16
    g = torch.Generator().manual_seed(0)
    w_q = torch.randn(n_head * hd, d_model, generator=g)  # (d_out, d_model)
    w_k = torch.randn(n_head * hd, d_model, generator=g)  # (d_out, d_model)
    rec = _as_dict(weight_records(w_q, w_k, n_head))
    assert set(rec) == {(h, m) for h in [*range(n_head), LAYER] for m in WEIGHT_METRICS}
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
    assert rec[(LAYER, "pr_qk_weight")] == pytest.approx(
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
    for m in ("pr_q_weight", "pr_k_weight", "pr_qk_weight"):
        assert rec[(LAYER, m)] == pytest.approx(n_head * hd, rel=1e-5)


def test_weight_records_rank_one_key() -> None:
    g = torch.Generator().manual_seed(1)
    w_q = torch.randn(8, 12, generator=g)  # (d_out, d_model), 2 heads of 4
    w_k = torch.randn(8, 1, generator=g) @ torch.randn(1, 12, generator=g)  # rank 1
    rec = _as_dict(weight_records(w_q, w_k, n_head=2))
    for h in (0, 1, LAYER):
        assert rec[(h, "pr_k_weight")] == pytest.approx(1.0, rel=1e-6)
        assert rec[(h, "pr_qk_weight")] == pytest.approx(1.0, rel=1e-6)


# --- TokenGeometry -----------------------------------------------------------------------


def _designed_qk(n_head: int = 3, hd: int = 2, B: int = 2, T: int = 12):
    """q: every head carries the same x in {±2e1, ±e2}; k: ±√d e_i over all d_out coords.

    Both designs are exactly zero-mean with known covariances:
    q per head ∝ diag(4, 1) -> PR = 25/17, and identical heads -> layer PR = 25/17 too;
    k ∝ I_{d_out} -> PR = hd per head and n_head·hd for the layer.
    """
    d_out = n_head * hd
    n = B * T
    x_cycle = torch.tensor([[2.0, 0.0], [-2.0, 0.0], [0.0, 1.0], [0.0, -1.0]])  # (4, hd)
    x = x_cycle.repeat(n // 4, 1)  # (N, hd)
    q = x.reshape(B, T, 1, hd).expand(B, T, n_head, hd).permute(0, 2, 1, 3)  # (B, H, T, hd)
    eye = torch.eye(d_out) * math.sqrt(d_out)  # (d_out, d_out)
    k_rows = torch.cat([eye, -eye]).repeat(n // (2 * d_out), 1)  # (N, d_out)
    k = k_rows.reshape(B, T, n_head, hd).permute(0, 2, 1, 3)  # (B, H, T, hd)
    return q.contiguous(), k.contiguous()


def test_token_geometry_hand_known_covariance_prs() -> None:
    n_head, hd = 3, 2
    q, k = _designed_qk(n_head, hd)
    tg = TokenGeometry(n_head, hd)
    tg.update(q[:1], k[:1])  # two updates: streaming must not matter
    tg.update(q[1:], k[1:])
    rec = _as_dict(tg.records())
    assert set(rec) == {(h, m) for h in [*range(n_head), LAYER] for m in TOKEN_METRICS}
    for h in range(n_head):
        assert rec[(h, "pr_q_token")] == pytest.approx(25 / 17, rel=1e-12)
        assert rec[(h, "pr_k_token")] == pytest.approx(hd, rel=1e-12)
    assert rec[(LAYER, "pr_q_token")] == pytest.approx(25 / 17, rel=1e-12)  # identical heads
    assert rec[(LAYER, "pr_k_token")] == pytest.approx(n_head * hd, rel=1e-12)  # isotropic
    for h in [*range(n_head), LAYER]:
        assert rec[(h, "contrast_token")] == rec[(h, "pr_q_token")] - rec[(h, "pr_k_token")]


def test_token_geometry_qk_and_attention_match_direct_computation() -> None:
    n_head, hd, B, T = 2, 3, 3, 7
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, n_head, T, hd, generator=g)  # (B, H, T, hd)
    k = torch.randn(B, n_head, T, hd, generator=g)  # (B, H, T, hd)
    tg = TokenGeometry(n_head, hd, causal=True)
    tg.update(q, k)
    rec = _as_dict(tg.records())
    logits = q.double() @ k.double().mT / math.sqrt(hd)  # (B, H, T, T)
    pr_seq = participation_ratio(torch.linalg.svdvals(logits) ** 2)  # (B, H)
    for h in range(n_head):
        assert rec[(h, "pr_qk_token")] == pytest.approx(float(pr_seq[:, h].mean()), rel=1e-9)
    assert rec[(LAYER, "pr_qk_token")] == pytest.approx(float(pr_seq.mean()), rel=1e-9)
    attn = AttentionStats(n_head, causal=True)
    attn.update(q, k)
    ref = attn.result()
    for name in ("attn_entropy", "attn_entropy_norm", "attn_max"):
        for h in range(n_head):
            assert rec[(h, name)] == pytest.approx(float(ref[name][h]), rel=1e-12)
        assert rec[(LAYER, name)] == pytest.approx(float(ref[name].mean()), rel=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_token_geometry_padding_equals_unpadded(causal: bool) -> None:
    n_head, hd = 2, 3
    g = torch.Generator().manual_seed(3)
    long = torch.randn(2, 1, n_head, 6, hd, generator=g)  # (q|k, 1, H, 6, hd)
    short = torch.randn(2, 1, n_head, 4, hd, generator=g)  # (q|k, 1, H, 4, hd)
    junk = 1e3 * torch.ones(2, 1, n_head, 2, hd)  # padding with values that would dominate
    padded = torch.cat([short, junk], dim=3)  # right padding
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])  # (B, T)
    batched = TokenGeometry(n_head, hd, causal=causal)
    batched.update(
        torch.cat([long[0], padded[0]]), torch.cat([long[1], padded[1]]), attention_mask=mask
    )
    separate = TokenGeometry(n_head, hd, causal=causal)
    separate.update(long[0], long[1])
    separate.update(short[0], short[1])
    got, want = _as_dict(batched.records()), _as_dict(separate.records())
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_token_geometry_rejects_bad_input() -> None:
    tg = TokenGeometry(2, 3)
    with pytest.raises(ValueError, match="update"):
        tg.records()
    with pytest.raises(ValueError):
        tg.update(torch.zeros(1, 3, 4, 3), torch.zeros(1, 3, 4, 3))


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


def test_end_to_end_layer_frame() -> None:
    n_head, hd, d_model = 2, 4, 8
    g = torch.Generator().manual_seed(4)
    w_q = torch.randn(n_head * hd, d_model, generator=g)  # (d_out, d_model)
    w_k = torch.randn(n_head * hd, d_model, generator=g)  # (d_out, d_model)
    x = torch.randn(2, 5, d_model, generator=g)  # (B, T, d_model)
    q = (x @ w_q.T).reshape(2, 5, n_head, hd).transpose(1, 2)  # (B, H, T, hd)
    k = (x @ w_k.T).reshape(2, 5, n_head, hd).transpose(1, 2)  # (B, H, T, hd)
    tg = TokenGeometry(n_head, hd)
    tg.update(q, k)
    frame = records_to_frame({0: weight_records(w_q, w_k, n_head) + tg.records()}, run_id="x")
    assert len(frame) == (n_head + 1) * len(METRIC_NAMES)
    assert set(frame["metric"]) == set(METRIC_NAMES)
    assert frame["value"].notna().all()
