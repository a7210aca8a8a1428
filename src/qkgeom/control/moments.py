"""Σ, the running centred covariance of each layer's key-projection input.

The keys attention compares are k = W_K·x on the inputs the layer actually receives, so
their spectrum is that of W_K Σ W_Kᵀ, not of W_K; centred, because a key offset common to a
row adds one logit the softmax ignores. A forward pre-hook sums x and xᵀx over every token
of training forwards only; :meth:`InputMoments.fold` turns them into one step of moving
averages (half-life :data:`HALF_LIFE` steps). Definitions and the measured choice of the
half-life: docs/definitions.md#scale-rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from qkgeom.arch import AttentionSite
from qkgeom.errors import QKGeomError

__all__ = ["HALF_LIFE", "SHRINK", "InputMoments"]

HALF_LIFE = 5  # steps: the averages forget half of their past in 5 updates
SHRINK = 1e-3  # ε of the regularised covariance Σ + ε·tr(Σ)/d·I
_DECAY = 0.5 ** (1.0 / HALF_LIFE)


class InputMoments:
    """Per site: the running E[x] (d,) and E[x xᵀ] (d, d), float64 on the weights' device."""

    def __init__(self, sites: Sequence[AttentionSite]) -> None:
        self.sites = list(sites)
        n = len(self.sites)
        self.means: list[Tensor | None] = [None] * n
        self.seconds: list[Tensor | None] = [None] * n
        self._sum: list[Tensor | None] = [None] * n
        self._sum_sq: list[Tensor | None] = [None] * n
        self._count = [0] * n
        self._handles = [site.k_module.register_forward_pre_hook(self.hook(j))
                         for j, site in enumerate(self.sites)]

    def hook(self, j: int) -> Any:
        """The forward pre-hook of site ``j`` (registered by the constructor)."""
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not (args and module.training and torch.is_grad_enabled()):
                return
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1]).float()  # (N, d)
            if self._sum_sq[j] is None:
                self._sum_sq[j] = x.mT @ x  # (d, d) float32, summed over tokens
                self._sum[j] = x.sum(dim=0)
            else:  # another forward before the step (e.g. gradient accumulation)
                self._sum_sq[j].addmm_(x.mT, x)
                self._sum[j].add_(x.sum(dim=0))
            self._count[j] += x.shape[0]
        return hook

    def fold(self) -> None:
        """One moving-average update per site from the forwards since the last fold."""
        for j, total in enumerate(self._sum_sq):
            if total is None:
                continue
            n = self._count[j]
            mean, second = self._sum[j].double() / n, total.double() / n
            if self.seconds[j] is None:
                self.means[j], self.seconds[j] = mean, second
            else:
                self.means[j].mul_(_DECAY).add_(mean, alpha=1 - _DECAY)
                self.seconds[j].mul_(_DECAY).add_(second, alpha=1 - _DECAY)
            self._sum[j] = self._sum_sq[j] = None
            self._count[j] = 0

    @property
    def ready(self) -> bool:
        """Whether every site has seen a training forward (Σ exists)."""
        return all(s is not None for s in self.seconds)

    def covariance(self, j: int) -> Tensor:
        """Σ of site ``j``: (d, d) float64, symmetric."""
        second, mean = self.seconds[j], self.means[j]
        if second is None:
            raise QKGeomError("the key control needs the key inputs: run a training forward "
                              "pass (model.train(), gradients on) before calling step()")
        cov = second - torch.outer(mean, mean)
        return (cov + cov.mT) / 2

    def regularised(self, j: int) -> Tensor:
        """Σ + ε·tr(Σ)/d·I of site ``j`` (:data:`SHRINK`): positive definite wherever W has
        full rank, and directions the recent batches never visited keep some variance."""
        cov = self.covariance(j)
        d = cov.shape[-1]
        ridge = SHRINK * torch.diagonal(cov).sum().clamp_min(0) / d
        return cov + ridge * torch.eye(d, dtype=cov.dtype, device=cov.device)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def state_dict(self) -> list[dict[str, Tensor] | None]:
        return [None if s is None else {"mean": m.detach().cpu().clone(),
                                        "second": s.detach().cpu().clone()}
                for m, s in zip(self.means, self.seconds, strict=True)]

    def load_state_dict(self, saved: list[dict[str, Tensor] | None]) -> None:
        if len(saved) != len(self.sites):
            raise QKGeomError(f"saved key-input moments cover {len(saved)} layers, this "
                              f"control {len(self.sites)}")
        means, seconds = [], []
        for item, site in zip(saved, self.sites, strict=True):
            if item is None:
                means.append(None)
                seconds.append(None)
                continue
            if not (isinstance(item, dict) and {"mean", "second"} <= set(item)):
                raise QKGeomError("saved key-input moments are not mean/second pairs: the "
                                  "checkpoint was written by another qkgeom; train again")
            dev = site.key_stored().device
            means.append(torch.as_tensor(item["mean"]).to(device=dev, dtype=torch.float64))
            seconds.append(torch.as_tensor(item["second"]).to(device=dev, dtype=torch.float64))
        self.means, self.seconds = means, seconds
        n = len(self.sites)
        self._sum, self._sum_sq, self._count = [None] * n, [None] * n, [0] * n
