"""Streaming covariances of token activations, float64, with Chan et al.'s pairwise merge.

Why streamed: a token PR needs the covariance over every token of a probe set or corpus,
which never fits in memory; only the count, mean and centred scatter are kept. Why Chan's
update: it never subtracts two large numbers, so activations with a large common offset
stay accurate (docs/definitions.md#how-the-metrics-are-computed).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkgeom.geometry.spectra import pr_from_covariance
from qkgeom.geometry.workspace import Workspace

__all__ = ["StreamingCovariance", "centred_scatter", "head_blocks"]

# Rows per internal chunk are chosen so one float64 chunk stays under this many elements
# (2**22 doubles = 32 MiB), whatever batch the caller passes.
_MAX_CHUNK_ELEMENTS = 2**22


class StreamingCovariance:
    """Running mean and centred scatter of ``n_groups`` independent ``dim``-vectors (one group
    per head, or one for a whole layer); every group sees the same samples, so ``count`` is
    shared."""

    def __init__(self, n_groups: int, dim: int, max_chunk_elements: int = _MAX_CHUNK_ELEMENTS):
        if n_groups < 1 or dim < 1:
            raise ValueError(f"n_groups and dim must be >= 1, got {n_groups}, {dim}")
        self.n_groups = n_groups
        self.dim = dim
        self.max_chunk_elements = max_chunk_elements
        self.count = 0  # samples seen per group
        self._mean = torch.zeros(n_groups, dim, dtype=torch.float64)  # (G, dim)
        self._m2 = torch.zeros(n_groups, dim, dim, dtype=torch.float64)  # (G, dim, dim)

    def update(self, x: Tensor) -> None:
        """Add N samples per group: ``x`` (G, N, dim), or (N, dim) with one group, any float
        dtype; the state follows ``x``'s device (a GPU does float64 matmuls far faster)."""
        if x.ndim == 2 and self.n_groups == 1:
            x = x.unsqueeze(0)  # (1, N, dim)
        if x.ndim != 3 or x.shape[0] != self.n_groups or x.shape[2] != self.dim:
            raise ValueError(
                f"expected (G={self.n_groups}, N, dim={self.dim}), got {tuple(x.shape)}"
            )
        x = x.detach()
        self._follow(x.device)
        rows = max(1, self.max_chunk_elements // (self.n_groups * self.dim))
        for start in range(0, x.shape[1], rows):
            self._merge_batch(x[:, start : start + rows].to(torch.float64))  # (G, n, dim)

    def _follow(self, device: torch.device) -> None:
        """Move the state to ``device`` (a no-op when it is there)."""
        self._mean, self._m2 = self._mean.to(device), self._m2.to(device)

    def _merge_batch(self, xb: Tensor) -> None:
        """Fold in a non-empty chunk ``xb`` (G, n, dim), float64."""
        mean_b = xb.mean(dim=1)  # (G, dim)
        xc = xb - mean_b[:, None, :]  # (G, n, dim)
        self._merge(xb.shape[1], mean_b, xc.mT @ xc)  # scatter (G, dim, dim)

    def _merge(self, n_b: int, mean_b: Tensor, m2_b: Tensor) -> None:
        n_a = self.count
        n = n_a + n_b
        delta = mean_b - self._mean  # (G, dim)
        self._mean = self._mean + delta * (n_b / n)  # (G, dim)
        self._m2 = self._m2 + m2_b + (delta[:, :, None] * delta[:, None, :]) * (n_a * n_b / n)
        self.count = n

    def add_moments(self, count: int, mean: Tensor, m2: Tensor) -> None:
        """Fold in a batch given as its count, (G, dim) mean and (G, dim, dim) centred scatter
        (e.g. a float32 product, :func:`centred_scatter`); the totals stay float64."""
        if mean.shape != self._mean.shape or m2.shape != self._m2.shape:
            raise ValueError(f"expected mean {tuple(self._mean.shape)} and scatter "
                             f"{tuple(self._m2.shape)}, got {tuple(mean.shape)}, {tuple(m2.shape)}")
        if count:
            self._follow(mean.device)
            self._merge(count, mean.to(torch.float64), m2.to(torch.float64))

    def merge(self, other: StreamingCovariance) -> None:
        """Fold another accumulator of the same shape into this one (e.g. from a worker)."""
        if (other.n_groups, other.dim) != (self.n_groups, self.dim):
            raise ValueError("cannot merge accumulators of different shapes")
        if other.count:
            dev = self._mean.device
            self._merge(other.count, other._mean.to(dev), other._m2.to(dev))

    def mean(self) -> Tensor:
        """(G, dim) float64 running mean (units of the activations)."""
        self._require(1)
        return self._mean.clone()

    def covariance(self, ddof: int = 1) -> Tensor:
        """(G, dim, dim) float64 ``M2 / (count - ddof)`` (``ddof=1`` as ``torch.cov``; a PR does
        not depend on it)."""
        self._require(ddof + 1)
        return self._m2 / (self.count - ddof)

    def scatter(self) -> Tensor:
        """(G, dim, dim) float64 centred scatter ``M2``, defined from one sample on (a PR is scale
        free)."""
        self._require(1)
        return self._m2.clone()

    def pr(self) -> Tensor:
        """(G,) float64 PR of each group's covariance (0.0 for zero variance)."""
        self._require(1)
        return pr_from_covariance(self._m2)

    def _require(self, n: int) -> None:
        if self.count < n:
            raise ValueError(f"need at least {n} samples, have {self.count}")


def head_blocks(cov: Tensor, n_head: int) -> Tensor:
    """(D, D) covariance of heads concatenated -> (n_head, hd, hd) diagonal blocks."""
    hd = cov.shape[-1] // n_head
    blocks = cov.view(n_head, hd, n_head, hd).diagonal(dim1=0, dim2=2)  # (hd, hd, H)
    return blocks.permute(2, 0, 1)  # (H, hd, hd)


def centred_scatter(x: Tensor, workspace: Workspace | None = None, name: str = "scatter",
                    feature_dims: int = 1) -> tuple[Tensor, Tensor]:
    """Float64 mean (D,) and centred scatter (D, D) of the vectors ``x`` (..., D), or of its
    last ``feature_dims`` dims flattened.

    Why float32 products: the scatter is the largest cost of the covariances. The batch is
    centred on its float32 mean c first, so only deviations are multiplied; with δ the
    residual mean of the centred rows, the scatter about the mean is ``S − n·δδᵀ`` and the
    mean ``c + δ``, both merged by the caller into float64 totals (:meth:`add_moments`)."""
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
