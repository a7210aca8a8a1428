"""Attack 7: numerical edge cases of the metrics. PR and entropy are finite and right (by
hand), or a clear NonFiniteError; a results table never holds NaN. Each case prints its
figure once it has passed its asserts."""

from __future__ import annotations

import math

import pytest
import torch
from fault_helpers import figure

from qkgeom.geometry import LayerGeometry, NonFiniteError, weight_records

B, H, T, HD = 2, 2, 8, 4


def _layer(q: torch.Tensor, k: torch.Tensor) -> dict[str, float]:
    g = LayerGeometry(q.shape[1], q.shape[1], q.shape[3])
    g.update(q, k)
    recs = g.records()
    assert all(math.isfinite(v) for _, _, v in recs), recs
    return {m: v for h, m, v in recs if h == -1}


def _qk(scale: float = 1.0, dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, HD, generator=gen, dtype=torch.float64) * scale
    k = torch.randn(B, H, T, HD, generator=gen, dtype=torch.float64) * scale
    return q.to(dtype), k.to(dtype)


def test_all_zero_activations() -> None:
    z = torch.zeros(B, H, T, HD)
    r = _layer(z, z)
    # Zero spectrum convention: PR 0; equal scores: uniform attention, H_t = log(t + 1).
    assert r["pr_q_token"] == r["pr_k_token"] == r["pr_qk_token"] == 0.0
    expect = sum(math.log(t + 1) for t in range(T)) / T
    assert r["attn_entropy"] == pytest.approx(expect, rel=1e-6)
    assert r["attn_entropy_norm"] == pytest.approx(1.0, rel=1e-6)
    figure("numerics", "all-zero activations: PR 0 (documented), entropy log(t+1)")


def test_single_token() -> None:
    q, k = torch.randn(1, H, 1, HD), torch.randn(1, H, 1, HD)
    r = _layer(q, k)
    assert r["attn_entropy"] == 0.0 and r["attn_max"] == 1.0
    assert "attn_entropy_norm" not in r  # undefined with one key: left out, never NaN
    assert r["pr_q_token"] == 0.0  # one sample: zero covariance
    figure("numerics", "single token: entropy 0, max 1, norm left out (undefined)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_match_float64(dtype: torch.dtype) -> None:
    """Half inputs run float32 products into float64 totals: float32 round-off of the
    float64 result on the same (rounded) values (measure() passes float64 by default)."""
    q, k = _qk(dtype=dtype)
    half = _layer(q, k)
    full = _layer(q.double(), k.double())  # the same (rounded) values in float64
    for name in ("pr_q_token", "pr_k_token", "pr_qk_token"):
        assert half[name] == pytest.approx(full[name], rel=1e-6)
    assert half["attn_entropy"] == pytest.approx(full["attn_entropy"], rel=1e-5)
    figure("numerics", f"{dtype}: PRs of float64 to float32 round-off")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_huge_magnitudes(dtype: torch.dtype) -> None:
    q, k = _qk(1e30, dtype)
    r = _layer(q, k)
    ref = _layer(*_qk(1.0, torch.float64))
    for name in ("pr_q_token", "pr_k_token", "pr_qk_token"):  # scale invariant
        assert r[name] == pytest.approx(ref[name], rel=1e-4)
    # Scores ~1e60: attention is one-hot (was NaN: float32 scores overflowed to inf).
    assert r["attn_entropy"] == pytest.approx(0.0, abs=1e-12)
    assert r["attn_max"] == pytest.approx(1.0)
    figure("numerics", f"1e30 {dtype}: PRs = unit-scale PRs, attention one-hot")


def test_nonfinite_or_overflowing_activations_are_a_clear_error() -> None:
    g = LayerGeometry(H, H, HD)
    for bad in (float("nan"), float("inf")):
        q, k = _qk()
        q[0, 0, 3, 1] = bad
        with pytest.raises(NonFiniteError, match="non-finite"):
            g.update(q, k)
    with pytest.raises(NonFiniteError, match="overflow"):
        g.update(*_qk(1e200, torch.float64))
    assert g.n_sequences == 0  # nothing half-accumulated
    figure("numerics", "inf/NaN/1e200 activations: NonFiniteError (a run records diverged)")


@pytest.mark.parametrize("scale", [1.0, 1e30, 1e200, 1e-300])
def test_rank_deficient_and_extreme_weights(scale: float) -> None:
    gen = torch.Generator().manual_seed(1)
    d_model, n_head, hd = 16, 2, 4
    u = torch.randn(n_head * hd, 1, generator=gen, dtype=torch.float64)
    v = torch.randn(1, d_model, generator=gen, dtype=torch.float64)
    w_q = (u @ v) * scale  # rank 1
    w_k = torch.randn(n_head * hd, d_model, generator=gen, dtype=torch.float64) * scale
    recs = {(h, m): val for h, m, val in weight_records(w_q, w_k, n_head)}
    assert all(math.isfinite(x) for x in recs.values())
    assert recs[(-1, "pr_q_weight")] == pytest.approx(1.0)  # rank 1: one direction
    for h in range(n_head):
        assert recs[(h, "pr_qk_weight")] == pytest.approx(1.0)  # rank-1 interaction
    unit = {(h, m): val for h, m, val in weight_records(w_q / scale, w_k / scale, n_head)}
    for key, val in unit.items():
        assert recs[key] == pytest.approx(val, rel=1e-9, abs=1e-9)
    with pytest.raises(NonFiniteError):
        weight_records(w_q * float("nan"), w_k, n_head)
    figure("numerics", f"rank-1 weights x{scale:g}: PR 1, scale invariant")
