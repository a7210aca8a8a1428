"""Participation ratios and singular spectra against hand-computed values and explicit routes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qkgeom.geometry import (
    interaction_singular_values,
    logit_singular_values,
    participation_ratio,
    pr_from_covariance,
    product_singular_values,
    weight_pr,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- participation_ratio ------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 7, 64])
def test_pr_isotropic_spectrum_is_n(n: int) -> None:
    assert float(participation_ratio(torch.full((n,), 0.3))) == pytest.approx(n, rel=1e-14)


@pytest.mark.parametrize(
    ("spectrum", "expected"),
    [
        ([5.0, 0.0, 0.0], 1.0),  # rank 1
        ([1.0, 1.0, 0.0, 0.0], 2.0),
        ([2.0, 1.0], 9.0 / 5.0),  # (2+1)² / (4+1)
        ([3.0, 1.0, 1.0], 25.0 / 11.0),
    ],
)
def test_pr_hand_values(spectrum: list[float], expected: float) -> None:
    assert float(participation_ratio(torch.tensor(spectrum))) == pytest.approx(expected, rel=1e-14)


def test_pr_accepts_lists_and_arrays_and_returns_float64() -> None:
    out = participation_ratio(np.array([2.0, 1.0], dtype=np.float32))
    assert out.dtype == torch.float64 and out.shape == ()
    assert float(participation_ratio([2, 1])) == pytest.approx(1.8)


def test_pr_batched_over_leading_dims() -> None:
    lam = torch.tensor([[[1.0, 1.0, 0.0], [2.0, 1.0, 0.0]], [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]])
    expected = torch.tensor([[2.0, 1.8], [1.0, 3.0]], dtype=torch.float64)
    torch.testing.assert_close(participation_ratio(lam), expected, rtol=1e-14, atol=0)


def test_pr_zero_spectrum_is_zero_not_nan() -> None:
    out = participation_ratio(torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert out.tolist() == [0.0, 2.0]


def test_pr_extreme_scales_do_not_overflow_or_underflow() -> None:
    assert float(participation_ratio(torch.tensor([1e-200, 1e-200], dtype=torch.float64))) == 2.0
    assert float(participation_ratio(torch.tensor([1e200, 1e200], dtype=torch.float64))) == 2.0


def test_pr_rejects_negative_and_empty() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        participation_ratio(torch.tensor([1.0, -0.5]))
    with pytest.raises(ValueError):
        participation_ratio(torch.zeros(3, 0))
    with pytest.raises(ValueError):
        participation_ratio(torch.tensor(1.0))


# --- pr_from_covariance ------------------------------------------------------------------


def test_pr_from_covariance_equals_eigenvalue_route() -> None:
    a = torch.randn(5, 7, 7, generator=_gen(1), dtype=torch.float64)  # (5, 7, 7)
    cov = a @ a.mT + 0.1 * torch.eye(7, dtype=torch.float64)  # (5, 7, 7) SPD
    via_eig = participation_ratio(torch.linalg.eigvalsh(cov))  # (5,)
    torch.testing.assert_close(pr_from_covariance(cov), via_eig, rtol=1e-12, atol=0)


def test_pr_from_covariance_hand_values() -> None:
    assert float(pr_from_covariance(torch.eye(9))) == pytest.approx(9.0, rel=1e-14)
    assert float(pr_from_covariance(torch.diag(torch.tensor([2.0, 1.0])))) == pytest.approx(1.8)
    # Rotation does not change the spectrum: rotate diag(2, 1) by 30°.
    c, s = math.cos(math.pi / 6), math.sin(math.pi / 6)
    rot = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    cov = rot @ torch.diag(torch.tensor([2.0, 1.0], dtype=torch.float64)) @ rot.T
    assert float(pr_from_covariance(cov)) == pytest.approx(1.8, rel=1e-14)
    assert float(pr_from_covariance(torch.zeros(4, 4))) == 0.0


def test_pr_from_covariance_rejects_non_square() -> None:
    with pytest.raises(ValueError):
        pr_from_covariance(torch.zeros(3, 4))


# --- weight_pr ---------------------------------------------------------------------------


def test_weight_pr_orthogonal_is_full_dim() -> None:
    torch.manual_seed(0)
    w = torch.nn.init.orthogonal_(torch.empty(16, 16))
    assert float(weight_pr(w)) == pytest.approx(16.0, rel=1e-6)
    wide = torch.nn.init.orthogonal_(torch.empty(8, 32))  # orthonormal rows
    assert float(weight_pr(wide)) == pytest.approx(8.0, rel=1e-6)
    assert float(weight_pr(wide.T)) == pytest.approx(8.0, rel=1e-6)


def test_weight_pr_rank_one_is_one() -> None:
    g = _gen(2)
    w = torch.randn(12, 1, generator=g) @ torch.randn(1, 20, generator=g)  # (12, 20) rank 1
    assert float(weight_pr(w)) == pytest.approx(1.0, rel=1e-9)


def test_weight_pr_equals_svd_route_batched() -> None:
    w = torch.randn(3, 10, 6, generator=_gen(3), dtype=torch.float64)  # (3, 10, 6)
    via_svd = participation_ratio(torch.linalg.svdvals(w) ** 2)  # (3,)
    torch.testing.assert_close(weight_pr(w), via_svd, rtol=1e-12, atol=0)
    torch.testing.assert_close(weight_pr(w.mT), via_svd, rtol=1e-12, atol=0)


# --- product / interaction / logit singular values ----------------------------------------


@pytest.mark.parametrize(("m", "n", "r"), [(20, 15, 4), (5, 6, 9), (8, 8, 8)])
def test_product_singular_values_both_routes(m: int, n: int, r: int) -> None:
    g = _gen(4)
    a = torch.randn(2, m, r, generator=g, dtype=torch.float64)  # (2, m, r)
    b = torch.randn(2, n, r, generator=g, dtype=torch.float64)  # (2, n, r)
    out = product_singular_values(a, b)  # (2, min(m, n, r))
    explicit = torch.linalg.svdvals(a @ b.mT)[:, : min(m, n, r)]  # (2, min(m, n, r))
    assert out.shape == (2, min(m, n, r))
    torch.testing.assert_close(out, explicit, rtol=1e-10, atol=1e-12)


def test_interaction_singular_values_equal_explicit_product_per_head() -> None:
    n_head, hd, d_model = 3, 4, 24
    g = _gen(5)
    w_q = torch.randn(n_head * hd, d_model, generator=g)  # (d_out, d_model), float32 on purpose
    w_k = torch.randn(n_head * hd, d_model, generator=g)  # (d_out, d_model)
    sv = interaction_singular_values(w_q, w_k, n_head)  # (H, hd)
    assert sv.shape == (n_head, hd) and sv.dtype == torch.float64
    for h in range(n_head):
        wq_h = w_q[h * hd : (h + 1) * hd].T.double()  # (d_model, hd) = W_Q^h
        wk_h = w_k[h * hd : (h + 1) * hd].T.double()  # (d_model, hd) = W_K^h
        full = torch.linalg.svdvals(wq_h @ wk_h.T)  # (d_model,)
        torch.testing.assert_close(sv[h], full[:hd], rtol=1e-10, atol=0)
        assert float(full[hd:].max()) < 1e-10 * float(full[0])  # rank <= hd
        pr_explicit = participation_ratio(full**2)
        assert float(participation_ratio(sv[h] ** 2)) == pytest.approx(
            float(pr_explicit), rel=1e-10
        )


def test_interaction_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        interaction_singular_values(torch.zeros(6, 8), torch.zeros(6, 8), n_head=4)
    with pytest.raises(ValueError):
        interaction_singular_values(torch.zeros(6, 8), torch.zeros(6, 7), n_head=2)


@pytest.mark.parametrize(("T", "hd"), [(10, 4), (3, 5)])
def test_logit_singular_values_equal_explicit_route(T: int, hd: int) -> None:
    g = _gen(6)
    q = torch.randn(2, 3, T, hd, generator=g)  # (B, H, T, hd)
    k = torch.randn(2, 3, T, hd, generator=g)  # (B, H, T, hd)
    out = logit_singular_values(q, k)  # (B, H, min(T, hd))
    logits = q.double() @ k.double().mT / math.sqrt(hd)  # (B, H, T, T)
    explicit = torch.linalg.svdvals(logits)[..., : min(T, hd)]  # (B, H, min(T, hd))
    torch.testing.assert_close(out, explicit, rtol=1e-9, atol=1e-12)
    # An explicit scale multiplies every singular value.
    torch.testing.assert_close(
        logit_singular_values(q, k, scale=2.0), explicit * 2.0 * math.sqrt(hd)
    )


def test_product_pr_from_grams_equals_the_svd_route():
    """The LAPACK-free PR of a·bᵀ (Gram traces) equals the PR of its singular values²."""
    from qkgeom.geometry.spectra import product_pr

    g = torch.Generator().manual_seed(3)
    a = torch.randn(5, 40, 8, generator=g, dtype=torch.float64)
    b = torch.randn(5, 30, 8, generator=g, dtype=torch.float64)
    b[1, :, 4:] = 0.0  # rank-deficient product in one batch item
    svd = participation_ratio(product_singular_values(a, b) ** 2)
    assert torch.allclose(product_pr(a, b), svd, rtol=1e-10)
    eye = torch.eye(6, dtype=torch.float64)
    assert float(product_pr(eye, eye)) == pytest.approx(6.0)  # flat spectrum: PR = r
    assert float(product_pr(eye, torch.zeros(3, 6, dtype=torch.float64))) == 0.0
