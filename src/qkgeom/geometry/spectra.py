"""Participation ratios and the singular spectra they are taken of.

The participation ratio ``PR(λ) = (Σλ)² / Σλ²`` of a non-negative spectrum is the paper's
effective dimension: it is ``n`` for ``n`` equal values, 1 for a single non-zero value, and
is invariant to the overall scale of the spectrum. It is dimensionless ("number of
directions"). Everything here is computed in float64 whatever the input dtype, because PR
is a ratio of sums of squares and float32/bf16 lose the small eigenvalues that decide it.

Zero spectrum convention: an all-zero spectrum (a dead head, an all-zero weight, a
covariance from a single sample) has no effective dimension. Rather than NaN (which would
silently poison seed means) or an exception (which would abort a whole streaming analysis
because of one degenerate head), its PR is defined as ``0.0`` -- the only value outside
``[1, n]``, so a degenerate head is visible in every table and plot.

Weight layout follows ``nn.Linear``: ``w_q``, ``w_k`` are ``(d_out, d_model)`` with
``d_out = n_head * head_dim`` and head ``h`` owning rows ``h*hd:(h+1)*hd``; in the paper's
notation ``W_Q = w_q.T`` and ``W_Q^h = w_q[h*hd:(h+1)*hd].T``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "NonFiniteError",
    "gram_product_pr",
    "interaction_singular_values",
    "logit_singular_values",
    "participation_ratio",
    "pr_from_covariance",
    "product_pr",
    "product_singular_values",
    "require_finite",
    "split_heads",
    "weight_pr",
]


class NonFiniteError(ValueError):
    """Weights or activations hold inf/NaN (or overflow float64): no metric is defined.

    Raised instead of returning NaN (or letting an SVD fail deep inside LAPACK), so that a
    caller can say what happened: the trainer records the run as ``diverged``.
    """


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


def participation_ratio(spectrum: Tensor | object) -> Tensor:
    """``(Σλ)² / Σλ²`` over the last dim of a non-negative spectrum, in float64.

    Why: the paper's effective dimension of queries, keys and interaction matrices.
    Batched over leading dims; a 1-D input gives a 0-dim tensor (use ``float()``).
    Accepts anything ``torch.as_tensor`` takes (tensor, ndarray, list).

    The spectrum is divided by its maximum before squaring, so the result is exactly scale
    invariant and neither overflows nor underflows for very large or very small values.
    An all-zero spectrum returns 0.0 (see the module docstring); NaN in gives NaN out.

    Raises:
        ValueError: for a 0-dim or empty spectrum, or any negative entry (eigenvalues from
            ``eigvalsh`` can be slightly negative by round-off: ``clamp_min(0)`` them first,
            or use :func:`pr_from_covariance`, which needs no eigendecomposition).
    """
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
    s1 = lam.sum(dim=-1)  # (...,)
    s2 = (lam * lam).sum(dim=-1)  # (...,)
    return torch.where(s2 > 0, s1 * s1 / torch.where(s2 > 0, s2, torch.ones_like(s2)), s1 * 0)


def pr_from_covariance(cov: Tensor) -> Tensor:
    """``tr(C)² / ‖C‖_F²`` of symmetric PSD matrices, batched over leading dims, float64.

    Why: for a symmetric C, ``tr C = Σλ`` and ``‖C‖_F² = Σλ²``, so this is the PR of the
    eigenvalues without an eigendecomposition (O(n²) instead of O(n³), and no negative
    round-off eigenvalues). Symmetry is assumed, not checked. Scale invariant; a zero
    matrix gives 0.0.

    Args:
        cov: (..., n, n) covariance (any scale: ddof does not matter for PR).
    Returns:
        (...,) float64 tensor.
    """
    c = torch.as_tensor(cov).to(torch.float64)  # (..., n, n)
    if c.ndim < 2 or c.shape[-1] != c.shape[-2] or c.shape[-1] == 0:
        raise ValueError(f"pr_from_covariance needs (..., n, n) with n > 0, got {tuple(c.shape)}")
    c = c / _max_over_last(c, 2)  # (..., n, n), max |entry| 1
    tr = torch.diagonal(c, dim1=-2, dim2=-1).sum(dim=-1)  # (...,)
    fro2 = (c * c).sum(dim=(-2, -1))  # (...,)
    return torch.where(
        fro2 > 0, tr * tr / torch.where(fro2 > 0, fro2, torch.ones_like(fro2)), tr * 0
    )


def weight_pr(w: Tensor) -> Tensor:
    """PR of the squared singular values of ``w`` (..., m, n), float64, batched.

    Why: the weight PR (``pr_q_weight``, ``pr_k_weight``). The squared singular
    values of W are the eigenvalues of its Gram matrix, so this is
    :func:`pr_from_covariance` of the smaller of ``WᵀW`` / ``WWᵀ`` -- no SVD. Invariant to
    transposition, so ``w_q`` rows (nn.Linear layout) and ``W_Q`` give the same value.
    An orthogonal (or semi-orthogonal) matrix gives min(m, n); a rank-1 matrix gives 1.
    """
    a = torch.as_tensor(w).to(torch.float64)  # (..., m, n)
    if a.ndim < 2:
        raise ValueError(f"weight_pr needs (..., m, n), got {tuple(a.shape)}")
    a = a / _max_over_last(a, 2)  # (..., m, n)
    gram = a.mT @ a if a.shape[-1] <= a.shape[-2] else a @ a.mT  # (..., r, r), r = min(m, n)
    return pr_from_covariance(gram)


def product_singular_values(a: Tensor, b: Tensor) -> Tensor:
    """Singular values of ``a @ b.mT`` without forming it when the shared dim is small.

    Why: the interaction matrix ``W_Q^h (W_K^h)ᵀ`` is d_model × d_model but has rank at
    most head_dim; forming it costs O(d²·hd) memory/time and then an O(d³) SVD. With
    ``a = Q_a R_a`` and ``b = Q_b R_b`` (reduced QR, orthonormal columns) we have
    ``a bᵀ = Q_a (R_a R_bᵀ) Q_bᵀ``, so its singular values are those of the r × r core.

    Args:
        a: (..., m, r); b: (..., n, r), same leading dims (broadcast).
    Returns:
        (..., min(m, n, r)) float64 singular values, descending.
    """
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
    """Singular values of each head's interaction matrix ``M_h = W_Q^h (W_K^h)ᵀ``.

    Why: the interaction spectrum; ``pr_qk_weight`` is the PR of their squares.
    Computed through QR of the two d_model × hd factors, never the d_model × d_model
    product (see :func:`product_singular_values`).

    Args:
        w_q, w_k: (d_out, d_model) nn.Linear weights, d_out = n_head * head_dim.
    Returns:
        (H, min(d_model, hd)) float64, descending per head (units of the weights squared).
    """
    if w_q.shape != w_k.shape or w_q.ndim != 2:
        raise ValueError(f"w_q {tuple(w_q.shape)} and w_k {tuple(w_k.shape)} must be equal 2-D")
    a = split_heads(w_q.detach(), n_head)  # (H, d_model, hd)
    b = split_heads(w_k.detach(), n_head)  # (H, d_model, hd)
    return product_singular_values(a, b)  # (H, min(d_model, hd))


def logit_singular_values(q: Tensor, k: Tensor, scale: float | None = None) -> Tensor:
    """Singular values of each sequence's logit matrix ``Q_h K_hᵀ · scale`` (T × T).

    Why: the token-level interaction spectrum (``pr_qk_token`` = PR of their squares).
    The matrix is the unmasked bilinear form on the sequence (no causal mask: masking
    would destroy its rank ≤ hd structure and is a property of the softmax, not of the
    query/key geometry). Uses the QR route when hd < T, so memory is O(T·hd) per head.
    Rows of q/k that are all zero (padding zeroed by the caller) only add zero singular
    values, which leave the PR unchanged.

    Args:
        q, k: (B, H, T, hd) per-head queries and keys, any float dtype.
        scale: logit scale, default 1/√hd (the definition).
    Returns:
        (B, H, min(T, hd)) float64, descending.
    """
    if q.shape != k.shape or q.ndim != 4:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be equal (B, H, T, hd)")
    hd = q.shape[-1]
    scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)
    # Both factors get √scale so the product carries the scale once.
    qs = q.detach().to(torch.float64) * math.sqrt(abs(scale))  # (B, H, T, hd)
    ks = k.detach().to(torch.float64) * math.sqrt(abs(scale))  # (B, H, T, hd)
    return product_singular_values(qs, ks)  # (B, H, min(T, hd))


def gram_product_pr(g_a: Tensor, g_b: Tensor) -> Tensor:
    """PR of the eigenvalues of ``G_a G_b`` for symmetric PSD ``G_a``, ``G_b`` (..., r, r).

    Why: with ``G_a = aᵀa`` and ``G_b = bᵀb`` the squared singular values of ``a bᵀ`` are
    the eigenvalues of ``M = G_a G_b``, so ``Σσ² = tr M`` and ``Σσ⁴ = tr M² = Σ_ij M_ij
    M_ji``: the PR of an interaction or logit spectrum costs one r × r product and no
    LAPACK call (a batched QR/SVD can stall for seconds in a multi-threaded LAPACK on a
    busy CPU). Each factor is divided by its largest diagonal entry (PR is scale free).
    Returns (...,) float64; 0.0 when the product is zero.
    """
    g_a = torch.as_tensor(g_a).to(torch.float64)  # (..., r, r)
    g_b = torch.as_tensor(g_b).to(torch.float64)  # (..., r, r)
    top_a = torch.diagonal(g_a, dim1=-2, dim2=-1).amax(-1).clamp_min(1e-300)  # (...,)
    top_b = torch.diagonal(g_b, dim1=-2, dim2=-1).amax(-1).clamp_min(1e-300)  # (...,)
    m = (g_a / top_a[..., None, None]) @ (g_b / top_b[..., None, None])  # (..., r, r)
    s1 = torch.diagonal(m, dim1=-2, dim2=-1).sum(-1)  # (...,) Σσ² (rescaled)
    s2 = (m * m.mT).sum(dim=(-2, -1))  # (...,) Σσ⁴ (rescaled)
    return torch.where(s2 > 0, s1 * s1 / torch.where(s2 > 0, s2, torch.ones_like(s2)), s1 * 0)


def product_pr(a: Tensor, b: Tensor) -> Tensor:
    """``participation_ratio(product_singular_values(a, b) ** 2)`` without QR or SVD.

    PR of the squared singular values of ``a @ b.mT`` from the two r × r Gram matrices
    (:func:`gram_product_pr`), float64, batched. Args: ``a`` (..., m, r), ``b`` (..., n, r).
    Returns (...,); 0.0 for a zero product. Scale the inputs into range first (the Grams
    square them).
    """
    a = torch.as_tensor(a).to(torch.float64)  # (..., m, r)
    b = torch.as_tensor(b).to(torch.float64)  # (..., n, r)
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"inner dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    return gram_product_pr(a.mT @ a, b.mT @ b)
