"""The one streaming accumulator of a layer's token-level metrics: :class:`LayerGeometry`.

Every token metric of qkgeom -- the trainer's probes, the monitor, checkpoint analysis --
goes through this class, so a number means the same thing whichever path produced it.
Per batch of captured q/k (q (B, H, T, hd), k (B, H_kv, T, hd), unpadded windows):

- q and k covariances, float64 running totals (:class:`~qkgeom.geometry.StreamingCovariance`,
  Chan's update) of the layer's heads concatenated; each head's covariance is a diagonal
  block of the layer's (:func:`~qkgeom.geometry.covariance.head_blocks`), so per-head PRs
  cost no second pass. Memory O((H·hd)²) for any token count.
- ``pr_qk_token``: PR of the squared singular values of each sequence's logit matrix
  ``Q_h K_hᵀ·scale``, mean over sequences (:func:`logit_pr`: two hd × hd Gram matrices, no
  SVD; equal to :func:`~qkgeom.geometry.spectra.logit_singular_values`' route).
- ``attn_*``: :class:`~qkgeom.geometry.entropy.StreamingEntropy` (online softmax).

Precision: the products of a batch (scatter, Grams, scores) run in the input's float type
-- float64 input gives float64 throughout (what probes use: exact, small inputs); float32
(or half) input gives float32 products merged into float64 totals (long corpora, fast).
Products that could overflow float32 (scores |q|·|k|·hd·scale beyond 1e37, activations
beyond 1e14) are computed in float64. Non-finite
activations, or entries beyond 1e140 (their float64 scatter would overflow), raise
:class:`~qkgeom.geometry.spectra.NonFiniteError` before anything is accumulated.

GQA: per query head h, ``pr_k_token`` is the PR of key head ``h // R`` (R = H / H_kv) and
the contrast pairs the two; the layer's ``pr_k_token`` is the PR of the H_kv distinct key
heads concatenated (equal to that of the keys repeated as the attention uses them: same
non-zero spectrum, scaled by R).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkgeom.geometry.covariance import StreamingCovariance, centred_scatter, head_blocks
from qkgeom.geometry.entropy import StreamingEntropy
from qkgeom.geometry.records import LAYER, Record, token_records
from qkgeom.geometry.spectra import NonFiniteError, gram_product_pr, pr_from_covariance
from qkgeom.geometry.workspace import Workspace

__all__ = ["LayerGeometry", "logit_pr"]

# Largest |activation| whose float64 scatter (sums of squares over ~1e9 tokens) stays finite.
_MAX_ABS_ACTIVATION = 1e140
_FLOAT32_SAFE = 1e37  # |score| bound above which float32 scores could overflow (max 3.4e38)
_FLOAT32_SCATTER_SAFE = 1e14  # |activation| above which a float32 scatter could overflow


def logit_pr(q: Tensor, k: Tensor) -> Tensor:
    """PR of the squared singular values of each sequence's logit matrix ``Q_h K_hᵀ``.

    Why not an SVD: with ``G_q = Q_hᵀQ_h`` and ``G_k = K_hᵀK_h`` (hd × hd), the
    squared singular values of ``Q_h K_hᵀ`` are the eigenvalues of ``M = G_q G_k``, so
    ``Σσ² = tr M`` and ``Σσ⁴ = tr M² = Σ_ij M_ij M_ji``: the PR costs two Gram matrices
    and one hd × hd product per sequence and head, no LAPACK call
    (:func:`~qkgeom.geometry.spectra.gram_product_pr`). Equal to
    ``participation_ratio(logit_singular_values(q, k)**2)`` (tested); scale-free.

    Args:
        q: (B, H, T, hd); k: (B, H_kv, T, hd), query head h paired with key head h // R.
    Returns:
        (B, H) float64; 0.0 for an all-zero logit matrix.
    """
    B, H, T, hd = q.shape
    Hk = k.shape[1]
    # Gram matrices in the activations' precision (at least float32: T-term sums of
    # products, relative error ~1e-7·√T), everything after in float64.
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.detach().to(dt).unflatten(1, (Hk, H // Hk)).transpose(2, 3)  # (B, Hk, T, R, hd)
    return _logit_pr_prepared(qg.reshape(B * Hk, T, H // Hk, hd),
                              k.detach().to(dt).reshape(B * Hk, T, hd), B)


def _logit_pr_prepared(qg: Tensor, kk: Tensor, B: int) -> Tensor:
    """:func:`logit_pr` from the layouts of :meth:`StreamingEntropy.prepare`: ``qg``
    (B·Hk, T, R, hd) (any common scale), ``kk`` (B·Hk, T, hd). Returns (B, H) float64."""
    BHk, T, R, hd = qg.shape
    if R == 1:
        q2 = qg.view(BHk, T, hd)  # (B·H, T, hd)
        g_q = torch.bmm(q2.mT, q2).view(B, BHk // B, 1, hd, hd)  # (B, Hk, 1, hd, hd)
    else:
        q2 = qg.permute(0, 2, 1, 3)  # (B·Hk, R, T, hd)
        g_q = (q2.mT @ q2).view(B, BHk // B, R, hd, hd)  # (B, Hk, R, hd, hd)
    g_k = torch.bmm(kk.mT, kk).view(B, BHk // B, 1, hd, hd)  # shared by the R query heads
    if qg.dtype == torch.float64:
        return gram_product_pr(g_q, g_k).flatten(1)  # (B, H), rescaled against overflow
    # float32 Grams: products of four of their entries (~1e±180 at worst) stay within
    # float64's range, so the traces need no rescaling (gram_product_pr's formula).
    m = g_q.double() @ g_k.double()  # (B, Hk, R, hd, hd) = G_q G_k
    s1 = torch.diagonal(m, dim1=-2, dim2=-1).sum(-1)  # (B, Hk, R) Σσ²
    s2 = (m * m.mT).sum(dim=(-2, -1))  # (B, Hk, R) Σσ⁴
    return torch.where(s2 > 0, s1 * s1 / s2, 0.0).flatten(1)  # (B, H)


class LayerGeometry:
    """Streams one layer's q/k into the token metrics (see the module docstring).

    Args:
        n_head, n_kv_head, head_dim: query heads, key heads, head size.
        causal: decoder (True) or encoder (False) attention.
        with_logit_spectrum: compute ``pr_qk_token`` (two hd × hd Gram matrices per
            sequence and head); when False the metric is left out of :meth:`records`.
        workspace: scratch buffers reused across batches, shared by all layers of one
            measurement (default: fresh temporaries per batch).
    """

    def __init__(self, n_head: int, n_kv_head: int, head_dim: int, causal: bool = True,
                 with_logit_spectrum: bool = True, workspace: Workspace | None = None) -> None:
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.cov_q = StreamingCovariance(1, n_head * head_dim)
        self.cov_k = StreamingCovariance(1, n_kv_head * head_dim)
        self.entropy = StreamingEntropy(n_head, n_kv_head, causal)
        self.with_logit_spectrum = with_logit_spectrum
        self.workspace = workspace
        self._sum_pr_qk = torch.zeros(n_head, dtype=torch.float64)
        self.n_sequences = 0
        self.n_tokens = 0

    @torch.no_grad()
    def update(self, q_site: Tensor, k_site: Tensor, q_attn: Tensor | None = None,
               k_attn: Tensor | None = None, scale: float | None = None) -> None:
        """Add a batch: covariances from ``q_site``/``k_site``, logit spectrum and entropy
        from ``q_attn``/``k_attn`` (what the attention computes with; default the same
        tensors). q (B, H, T, hd), k (B, H_kv, T, hd); ``scale`` defaults to 1/√hd.

        Raises:
            NonFiniteError: non-finite q/k, or entries beyond 1e140 (checked first, so the
                accumulator stays usable).
        """
        q_attn = q_site if q_attn is None else q_attn
        k_attn = k_site if k_attn is None else k_attn
        B, H, T, hd = q_attn.shape
        if (H, hd) != (self.n_head, self.head_dim) or k_attn.shape != (B, self.n_kv_head, T, hd):
            raise ValueError(f"expected q (B, {self.n_head}, T, {self.head_dim}) and k (B, "
                             f"{self.n_kv_head}, T, {self.head_dim}), got {tuple(q_attn.shape)} "
                             f"and {tuple(k_attn.shape)}")
        scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)
        tensors = {id(t): t for t in (q_site, k_site, q_attn, k_attn)}  # site = attn: once
        amax = dict(zip(tensors, torch.stack([t.detach().abs().amax().double()
                                              for t in tensors.values()]).tolist(), strict=True))
        peak = max(amax.values())  # one host sync for all of them
        if not peak <= _MAX_ABS_ACTIVATION:  # NaN fails this too
            raise NonFiniteError(f"queries/keys are non-finite or beyond {_MAX_ABS_ACTIVATION:g} "
                                 f"(max |entry| {peak:g}): their covariance would overflow")
        bound = amax[id(q_attn)] * amax[id(k_attn)] * hd * abs(scale)  # |score| bound
        if q_attn.dtype != torch.float64 and bound > _FLOAT32_SAFE:
            q_attn, k_attn = q_attn.double(), k_attn.double()  # float32 scores would overflow
        if q_site.dtype != torch.float64 and peak > _FLOAT32_SCATTER_SAFE:
            q_site, k_site = q_site.double(), k_site.double()  # so would a float32 scatter
        ws = self.workspace or Workspace()
        for cov, x, name in ((self.cov_q, q_site, "cov.q"), (self.cov_k, k_site, "cov.k")):
            mean, m2 = centred_scatter(x.transpose(1, 2), ws, name, 2)  # rows (B, T), heads·hd
            cov.add_moments(B * T, mean[None], m2[None])  # one group: all heads concatenated
        qg, kk = self.entropy.prepare(q_attn, k_attn, scale, ws)  # (B·Hk, T, R, hd), (B·Hk, T, hd)
        if self.with_logit_spectrum:
            self._sum_pr_qk = self._sum_pr_qk.to(qg.device)
            self._sum_pr_qk += _logit_pr_prepared(qg, kk, B).sum(dim=0)  # (H,)
        self.entropy.add_prepared(qg, kk, B, workspace=ws)
        self.n_sequences += B
        self.n_tokens += B * T

    def records(self) -> list[Record]:
        """Records of the token metrics, query heads 0..H−1 then −1 (layer)."""
        if self.n_sequences == 0:
            raise ValueError("LayerGeometry has no tokens; call update() first")
        cov_q = self.cov_q.scatter()[0]  # (H·hd, H·hd), covariance up to its scale
        cov_k = self.cov_k.scatter()[0]  # (Hk·hd, Hk·hd)
        pr_q = pr_from_covariance(head_blocks(cov_q, self.n_head)).cpu()  # (H,)
        pr_k = pr_from_covariance(head_blocks(cov_k, self.n_kv_head)).cpu()  # (Hk,)
        R = self.n_head // self.n_kv_head
        pr_qk = (self._sum_pr_qk.cpu() / self.n_sequences if self.with_logit_spectrum
                 else torch.full((self.n_head,), float("nan"), dtype=torch.float64))
        attn = self.entropy.result()
        out: list[Record] = []
        for h in range(self.n_head):
            out += token_records(h, float(pr_q[h]), float(pr_k[h // R]), float(pr_qk[h]),
                                 {n: float(v[h]) for n, v in attn.items()})
        out += token_records(LAYER, float(pr_from_covariance(cov_q)),
                             float(pr_from_covariance(cov_k)), float(pr_qk.mean()),
                             {n: float(v.mean()) for n, v in attn.items()})
        return out

    def key_covariance(self) -> Tensor:
        """(H_kv·hd, H_kv·hd) float64 covariance of the layer's keys."""
        return self.cov_k.covariance()[0]
