"""Per-layer streaming accumulator of the token-level metrics of a pretrained model.

The same SPEC §2 metrics as :class:`qkgeom.geometry.TokenGeometry` (so a table from a
checkpoint analysis reads like a training run's probes), built for long corpora and
grouped-query attention:

- q and k covariances are accumulated in float64 (:class:`~qkgeom.geometry.StreamingCovariance`,
  Chan's update) once per layer over all heads concatenated; each batch's centred scatter is
  one float32 matrix product (:func:`centred_scatter`), merged into the float64 totals.
  Each head's covariance is the diagonal block of the layer's, so per-head PRs cost no
  second pass. Memory O((H·hd)²) for any token count.
- ``pr_qk_token``: PR of the squared singular values of each sequence's logit matrix
  ``Q_h K_hᵀ·scale``, mean over sequences (:func:`logit_pr`: from two hd × hd Gram
  matrices, the same number as :func:`~qkgeom.geometry.logit_singular_values` gives).
- ``attn_*``: :class:`~qkgeom.pretrained.entropy.StreamingEntropy` (online softmax).

GQA: per query head h, ``pr_k_token`` is the PR of key head ``h // R`` (R = H / H_kv) and
the contrast pairs the two; the layer's ``pr_k_token`` is the PR of the H_kv distinct key
heads concatenated (equal to that of the keys repeated as the attention uses them).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkgeom.geometry import LAYER, StreamingCovariance
from qkgeom.geometry.records import Record, _token_block
from qkgeom.geometry.spectra import gram_product_pr, pr_from_covariance
from qkgeom.pretrained.entropy import StreamingEntropy
from qkgeom.pretrained.workspace import Workspace

__all__ = ["LayerGeometry", "centred_scatter", "head_blocks", "logit_pr"]


def head_blocks(cov: Tensor, n_head: int) -> Tensor:
    """(D, D) covariance of heads concatenated -> (n_head, hd, hd) diagonal blocks."""
    hd = cov.shape[-1] // n_head
    blocks = cov.view(n_head, hd, n_head, hd).diagonal(dim1=0, dim2=2)  # (hd, hd, H)
    return blocks.permute(2, 0, 1)  # (H, hd, hd)


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


def centred_scatter(x: Tensor, workspace: Workspace | None = None, name: str = "scatter",
                    feature_dims: int = 1) -> tuple[Tensor, Tensor]:
    """Float64 mean (D,) and centred scatter (D, D) of the vectors ``x`` (..., D), or of
    the last ``feature_dims`` dims flattened (e.g. (B, T, H, hd) with 2: D = H·hd).

    Why float32: the scatter is one (D × N)(N × D) product per batch, the largest cost of
    the covariances. The batch is centred on its (pairwise-summed) float32 mean c, so a
    large common offset costs no precision: only deviations are multiplied; the product
    runs in float32 (float64 for float64 input). With δ the residual mean of the centred
    rows (a sum of deviations, accurate in float32), the scatter about the batch mean is
    ``S − n·δδᵀ`` and the mean ``c + δ`` (in float64). The caller merges both into float64 running totals
    (:meth:`~qkgeom.geometry.StreamingCovariance.add_moments`, Chan's update), so the
    accumulation over batches is float64 throughout.
    """
    features = tuple(x.shape[x.ndim - feature_dims:])
    D = math.prod(features)
    n = x.numel() // D
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = tuple(range(x.ndim - feature_dims))
    centre = x.detach().sum(dim=rows, dtype=dt) / n  # (*features,) ≈ the mean (pairwise sum)
    ws = workspace or Workspace()
    xc = torch.sub(x.detach(), centre, out=ws.get(name, tuple(x.shape), dt, x.device))
    xc = xc.view(n, D)  # (N, D) centred rows
    off = xc.sum(dim=0).to(torch.float64) / n  # (D,) residual mean (sums of deviations)
    m2 = (xc.mT @ xc).to(torch.float64)  # (D, D) scatter about the centre
    mean = centre.reshape(D).to(torch.float64) + off  # (D,) float64 batch mean
    return mean, m2.addr_(off, off, alpha=-n)  # scatter about the mean


class LayerGeometry:
    """Streams one layer's q/k of a pretrained model into the SPEC §2 token metrics.

    Args:
        n_head, n_kv_head, head_dim: query heads, key heads, head size.
        causal: decoder (True) or encoder (False) attention.
        with_logit_spectrum: compute ``pr_qk_token`` (two hd × hd Gram matrices per
            sequence and head, :func:`logit_pr`); when False the metric is NaN.
        workspace: scratch buffers to reuse across batches, shared by all layers of one
            analysis (default: fresh temporaries per batch).
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
    def update(self, q_site: Tensor, k_site: Tensor, q_attn: Tensor, k_attn: Tensor,
               scale: float | None = None) -> None:
        """Add a batch: covariances from ``q_site``/``k_site``, logit spectrum and entropy
        from ``q_attn``/``k_attn`` (what the attention computes with). q (B, H, T, hd),
        k (B, H_kv, T, hd). Nothing is copied to the host (no device sync)."""
        B, H, T, hd = q_site.shape
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
        """Records of the seven token metrics, query heads 0..H−1 then −1 (layer)."""
        if self.n_sequences == 0:
            raise ValueError("LayerGeometry has no tokens; call update() first")
        cov_q = self.cov_q.covariance()[0]  # (H·hd, H·hd)
        cov_k = self.cov_k.covariance()[0]  # (Hk·hd, Hk·hd)
        pr_q = pr_from_covariance(head_blocks(cov_q, self.n_head)).cpu()  # (H,)
        pr_k = pr_from_covariance(head_blocks(cov_k, self.n_kv_head)).cpu()  # (Hk,)
        R = self.n_head // self.n_kv_head
        pr_qk = (self._sum_pr_qk.cpu() / self.n_sequences if self.with_logit_spectrum
                 else torch.full((self.n_head,), float("nan"), dtype=torch.float64))
        attn = self.entropy.result()
        out: list[Record] = []
        for h in range(self.n_head):
            out += _token_block(h, float(pr_q[h]), float(pr_k[h // R]), float(pr_qk[h]),
                                {n: float(v[h]) for n, v in attn.items()})
        out += _token_block(LAYER, float(pr_from_covariance(cov_q)),
                            float(pr_from_covariance(cov_k)), float(pr_qk.mean()),
                            {n: float(v.mean()) for n, v in attn.items()})
        return out
