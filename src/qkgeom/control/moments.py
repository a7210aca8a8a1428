"""Σ, the running centred covariance of each layer's key-projection input.

The keys attention compares are k = W_K·x on the inputs the layer actually receives, so
their spectrum is that of W_K Σ W_Kᵀ, not of W_K; centred, because a key offset common to a
row adds one logit the softmax ignores. A forward pre-hook sums x and xᵀx over every token
of training forwards only; :meth:`InputMoments.fold` turns them into one step of moving
averages (half-life :data:`HALF_LIFE` steps) and keeps that step's batch covariance alone,
on which the control measures the previous step's keys out of sample. Definitions:
docs/definitions.md#scale-rule; the estimator measured against others by what the E3 hold
reaches on the probe set: docs/control.md#the-holds-estimator-measured.
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


def _centred(second: Tensor, mean: Tensor) -> Tensor:
    """E[x xᵀ] − E[x] E[x]ᵀ, symmetrised."""
    cov = second - torch.outer(mean, mean)
    return (cov + cov.mT) / 2


class InputMoments:
    """Per site: the running E[x] (d,) and E[x xᵀ] (d, d), float64 on the weights' device,
    and the centred covariance of the forwards of the last fold alone (:meth:`batch`).
    ``half_life`` 0: the running averages are those of the last fold's forwards only."""

    def __init__(self, sites: Sequence[AttentionSite], *, half_life: float = HALF_LIFE,
                 shrink: float = SHRINK) -> None:
        if half_life < 0 or shrink < 0:
            raise QKGeomError(f"input moments need half_life >= 0 and shrink >= 0, got "
                              f"{half_life} and {shrink}")
        self.sites = list(sites)
        self.half_life, self.shrink = float(half_life), float(shrink)
        self._decay = 0.5 ** (1.0 / half_life) if half_life > 0 else 0.0
        n = len(self.sites)
        self.means: list[Tensor | None] = [None] * n
        self.seconds: list[Tensor | None] = [None] * n
        self.batches: list[Tensor | None] = [None] * n  # the last fold's covariance
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
            if total is None:  # no forward since the last fold: Σ stays, no batch of its own
                self.batches[j] = None
                continue
            n = self._count[j]
            mean, second = self._sum[j].double() / n, total.double() / n
            self.batches[j] = _centred(second, mean)
            if self.seconds[j] is None or self._decay == 0:
                self.means[j], self.seconds[j] = mean, second
            else:
                self.means[j].mul_(self._decay).add_(mean, alpha=1 - self._decay)
                self.seconds[j].mul_(self._decay).add_(second, alpha=1 - self._decay)
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
        return _centred(second, mean)

    def batch(self, j: int) -> Tensor | None:
        """The centred covariance (d, d) float64 of site ``j``'s inputs in the forwards of
        the last :meth:`fold` alone, no ε: the out-of-sample Σ of the keys set one step
        before (None before the first fold, and after a resume until the next)."""
        return self.batches[j]

    def ridge(self, j: int) -> Tensor:
        """ε·tr(Σ)/d of site ``j`` (ε = ``shrink``), a float64 scalar: Σ_ε = Σ + ridge·I."""
        cov = self.covariance(j)
        return self.shrink * torch.diagonal(cov).sum().clamp_min(0) / cov.shape[-1]

    def regularised(self, j: int) -> Tensor:
        """Σ + ε·tr(Σ)/d·I of site ``j`` (:meth:`ridge`): positive definite wherever W has
        full rank, and directions the recent batches never visited keep some variance."""
        cov = self.covariance(j)
        eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
        return cov + self.ridge(j) * eye

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
        self.batches = [None] * n
        self._sum, self._sum_sq, self._count = [None] * n, [None] * n, [0] * n
