"""Participation ratios and the singular spectra they are taken of, always in float64.

Why float64: a PR is a ratio of sums of squares, and float32/bf16 lose the small
eigenvalues that decide it. The zero-spectrum convention (PR 0.0) and the ``nn.Linear``
weight layout: docs/definitions.md#participation-ratio and #notation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "NonFiniteError", "gram_product_pr", "interaction_singular_values", "logit_singular_values",
    "participation_ratio", "pr_from_covariance", "product_pr", "product_singular_values",
    "require_finite", "split_heads", "weight_pr"
]


class NonFiniteError(ValueError):
    """Weights or activations hold inf/NaN (or overflow float64): no metric is defined, and
    the trainer records the run as ``diverged`` instead of storing NaN."""


def require_finite(what: str, *tensors: Tensor) -> None:
    """:class:`NonFiniteError` unless every entry of every tensor is finite."""
    for t in tensors:
        if not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"non-finite {what} (inf or NaN)")


def _max_over_last(x: Tensor, n_dims: int) -> Tensor:
    """Max of |x| over the last ``n_dims`` dims, kept for broadcasting (1 where it is 0)."""
    m = x.abs().flatten(start_dim=x.ndim - n_dims).amax(dim=-1)  # (...,)
    m = torch.where(m > 0, m, torch.ones_like(m))  # (...,)
    return m.reshape(m.shape + (1,) * n_dims)


def pr_of_sums(s1: Tensor, s2: Tensor) -> Tensor:
    """The PR ``s1² / s2`` of ``s1 = Σλ``, ``s2 = Σλ²``; 0.0 where ``s2`` is 0."""
    return torch.where(s2 > 0, s1 * s1 / torch.where(s2 > 0, s2, torch.ones_like(s2)), s1 * 0)


def participation_ratio(spectrum: Tensor | object) -> Tensor:
    """``(Σλ)² / Σλ²`` over the last dim of a non-negative spectrum, float64, batched.

    Divided by its maximum first, so exactly scale invariant and never over- or
    underflowing; all zero gives 0.0, NaN gives NaN. A 0-dim, empty or negative spectrum is
    a ValueError (``clamp_min(0)`` eigenvalues first, or use :func:`pr_from_covariance`)."""
    lam = torch.as_tensor(spectrum).to(torch.float64)  # (..., n)
    if lam.ndim == 0 or lam.shape[-1] == 0:
        raise ValueError(
            f"participation_ratio needs a non-empty last dim, got shape {tuple(lam.shape)}"
        )
    if bool((lam < 0).any()):
        raise ValueError(
            f"participation_ratio needs a non-negative spectrum; min = {lam.min().item():.3g}"
        )
    lam = lam / _max_over_last(lam, 1)  # (..., n), max entry 1 (or all zero)
    return pr_of_sums(lam.sum(dim=-1), (lam * lam).sum(dim=-1))


def pr_from_covariance(cov: Tensor) -> Tensor:
    """``tr(C)² / ‖C‖_F²`` of symmetric PSD ``cov`` (..., n, n), float64, batched: the PR of
    its eigenvalues without an eigendecomposition (O(n²), no negative round-off
    eigenvalues). Symmetry is assumed; a zero matrix gives 0.0."""
    c = torch.as_tensor(cov).to(torch.float64)  # (..., n, n)
    if c.ndim < 2 or c.shape[-1] != c.shape[-2] or c.shape[-1] == 0:
        raise ValueError(f"pr_from_covariance needs (..., n, n) with n > 0, got {tuple(c.shape)}")
    c = c / _max_over_last(c, 2)  # (..., n, n), max |entry| 1
    tr = torch.diagonal(c, dim1=-2, dim2=-1).sum(dim=-1)  # (...,)
    return pr_of_sums(tr, (c * c).sum(dim=(-2, -1)))  # tr² / ‖C‖_F²


def weight_pr(w: Tensor) -> Tensor:
    """PR of the squared singular values of ``w`` (..., m, n), float64, batched: the
    :func:`pr_from_covariance` of the smaller Gram matrix, no SVD (so ``w_q`` and ``W_Q``
    give the same value)."""
    a = torch.as_tensor(w).to(torch.float64)  # (..., m, n)
    if a.ndim < 2:
        raise ValueError(f"weight_pr needs (..., m, n), got {tuple(a.shape)}")
    a = a / _max_over_last(a, 2)  # (..., m, n)
    gram = a.mT @ a if a.shape[-1] <= a.shape[-2] else a @ a.mT  # (..., r, r), r = min(m, n)
    return pr_from_covariance(gram)


def product_singular_values(a: Tensor, b: Tensor) -> Tensor:
    """Singular values of ``a @ b.mT`` ((..., m, r), (..., n, r)), float64, descending.

    Why: an interaction matrix ``W_Q^h W_K^hᵀ`` is d × d of rank ≤ hd; with reduced QRs
    ``a bᵀ = Q_a (R_a R_bᵀ) Q_bᵀ``, so the r × r core has its singular values."""
    a = torch.as_tensor(a).to(torch.float64)  # (..., m, r)
    b = torch.as_tensor(b).to(torch.float64)  # (..., n, r)
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"inner dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    m, r = a.shape[-2], a.shape[-1]
    n = b.shape[-2]
    if r < min(m, n):
        r_a = torch.linalg.qr(a, mode="r").R  # (..., r, r)
        r_b = torch.linalg.qr(b, mode="r").R  # (..., r, r)
        return torch.linalg.svdvals(r_a @ r_b.mT)  # (..., r)
    return torch.linalg.svdvals(a @ b.mT)  # (..., min(m, n))


def split_heads(w: Tensor, n_head: int) -> Tensor:
    """nn.Linear weight (d_out, d_model) -> per-head W^h = (H, d_model, hd)."""
    d_out, d_model = w.shape
    if d_out % n_head != 0:
        raise ValueError(f"d_out={d_out} is not divisible by n_head={n_head}")
    hd = d_out // n_head
    return w.reshape(n_head, hd, d_model).mT  # (H, d_model, hd)


def interaction_singular_values(w_q: Tensor, w_k: Tensor, n_head: int) -> Tensor:
    """(H, min(d_model, hd)) singular values of each head's ``W_Q^h W_K^hᵀ`` from (d_out,
    d_model) weights, by :func:`product_singular_values` (``pr_qk_weight`` is their PR)."""
    if w_q.shape != w_k.shape or w_q.ndim != 2:
        raise ValueError(f"w_q {tuple(w_q.shape)} and w_k {tuple(w_k.shape)} must be equal 2-D")
    a = split_heads(w_q.detach(), n_head)  # (H, d_model, hd)
    b = split_heads(w_k.detach(), n_head)  # (H, d_model, hd)
    return product_singular_values(a, b)  # (H, min(d_model, hd))


def logit_singular_values(q: Tensor, k: Tensor, scale: float | None = None) -> Tensor:
    """(B, H, min(T, hd)) singular values of each sequence's unmasked ``Q_h K_hᵀ · scale``
    (q, k (B, H, T, hd); scale default 1/√hd), by the QR route; ``pr_qk_token`` is their PR
    (docs/definitions.md#interaction-spectrum)."""
    if q.shape != k.shape or q.ndim != 4:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be equal (B, H, T, hd)")
    hd = q.shape[-1]
    scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)
    # Both factors get √scale so the product carries the scale once.
    qs = q.detach().to(torch.float64) * math.sqrt(abs(scale))  # (B, H, T, hd)
    ks = k.detach().to(torch.float64) * math.sqrt(abs(scale))  # (B, H, T, hd)
    return product_singular_values(qs, ks)  # (B, H, min(T, hd))


def gram_product_pr(g_a: Tensor, g_b: Tensor) -> Tensor:
    """PR of the eigenvalues of ``G_a G_b`` (symmetric PSD, (..., r, r)), float64; 0.0 when zero.

    Why: with ``G = aᵀa`` these are σ²(a bᵀ), so ``Σσ² = tr M``, ``Σσ⁴ = Σ_ij M_ij M_ji``:
    one r × r product and no LAPACK call (a batched QR/SVD can stall a busy multi-threaded
    LAPACK). Each factor is divided by its largest diagonal entry first."""
    g_a = torch.as_tensor(g_a).to(torch.float64)  # (..., r, r)
    g_b = torch.as_tensor(g_b).to(torch.float64)  # (..., r, r)
    top_a = torch.diagonal(g_a, dim1=-2, dim2=-1).amax(-1).clamp_min(1e-300)  # (...,)
    top_b = torch.diagonal(g_b, dim1=-2, dim2=-1).amax(-1).clamp_min(1e-300)  # (...,)
    m = (g_a / top_a[..., None, None]) @ (g_b / top_b[..., None, None])  # (..., r, r)
    s1 = torch.diagonal(m, dim1=-2, dim2=-1).sum(-1)  # (...,) Σσ² (rescaled)
    return pr_of_sums(s1, (m * m.mT).sum(dim=(-2, -1)))  # Σσ⁴ (rescaled)


def product_pr(a: Tensor, b: Tensor) -> Tensor:
    """``participation_ratio(product_singular_values(a, b) ** 2)`` from the two Gram matrices
    (:func:`gram_product_pr`), float64, batched; scale the inputs into range first."""
    a = torch.as_tensor(a).to(torch.float64)  # (..., m, r)
    b = torch.as_tensor(b).to(torch.float64)  # (..., n, r)
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"inner dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    return gram_product_pr(a.mT @ a, b.mT @ b)
