"""The running second moment S ≈ E[x xᵀ] of each layer's key-projection input (data scale).

Why: the ``data`` scale rule keeps tr(W S Wᵀ), the mean squared key norm on the inputs the
layer actually receives. ‖W_K‖_F is that only when the inputs are isotropic; a LayerNorm
output that lives in a few directions makes reshaping W_K move energy into directions the
keys never use, so the logits shrink although ‖W_K‖_F is kept (docs/definitions.md#scale-rule).

How: a forward pre-hook on each site's key module (for fused q/k/v the same module, whose
input is the same x) adds xᵀx of the batch to a pending sum, only in training forwards
(``module.training`` and gradients on: probes and evaluation run without gradients).
:meth:`InputMoments.fold` turns what is pending into one update of an exponential moving
average with a half-life of :data:`HALF_LIFE` steps, initialised from the first batch.
At most :data:`MAX_TOKENS` evenly strided tokens of each forward are used: the full xᵀx
of a batch costs as much as the key projection's forward itself, and 512 tokens a batch,
over the ~30 batches the moving average remembers, still estimate a d × d moment from
~15 000 tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from qkgeom.arch import AttentionSite
from qkgeom.errors import QKGeomError

__all__ = ["HALF_LIFE", "MAX_TOKENS", "InputMoments"]

HALF_LIFE = 20  # steps: S forgets half of its past in 20 updates
MAX_TOKENS = 512  # tokens per forward pass used for xᵀx (evenly strided)
_DECAY = 0.5 ** (1.0 / HALF_LIFE)


class InputMoments:
    """S per site: float64 (d_model, d_model) tensors on the weights' device."""

    def __init__(self, sites: Sequence[AttentionSite]) -> None:
        self.sites = list(sites)
        n = len(self.sites)
        self.moments: list[Tensor | None] = [None] * n
        self._sum: list[Tensor | None] = [None] * n
        self._count = [0] * n
        self._handles = [site.k_module.register_forward_pre_hook(self.hook(j))
                         for j, site in enumerate(self.sites)]

    def hook(self, j: int) -> Any:
        """The forward pre-hook of site ``j`` (registered by the constructor)."""
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not (args and module.training and torch.is_grad_enabled()):
                return
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1])  # (N, d)
            stride = max(1, math.ceil(x.shape[0] / MAX_TOKENS))
            xs = x[::stride].float()  # (n, d)
            if self._sum[j] is None:
                self._sum[j] = xs.mT @ xs  # (d, d) float32, summed over tokens
            else:  # another forward before the step (e.g. gradient accumulation)
                self._sum[j].addmm_(xs.mT, xs)
            self._count[j] += xs.shape[0]
        return hook

    def fold(self) -> None:
        """One moving-average update per site from the forwards since the last fold."""
        for j, total in enumerate(self._sum):
            if total is None:
                continue
            old, total = self.moments[j], total.double()
            if old is None:
                self.moments[j] = total / self._count[j]
            else:
                old.mul_(_DECAY).add_(total, alpha=(1 - _DECAY) / self._count[j])
            self._sum[j], self._count[j] = None, 0

    def matrix(self, j: int) -> Tensor:
        s = self.moments[j]
        if s is None:
            raise QKGeomError("key control with scale=data needs the key inputs: run a "
                              "training forward pass (model.train(), gradients on) before "
                              "calling step()")
        return s

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def state_dict(self) -> list[Tensor | None]:
        return [None if s is None else s.detach().cpu().clone() for s in self.moments]

    def load_state_dict(self, saved: list[Tensor | None]) -> None:
        if len(saved) != len(self.sites):
            raise QKGeomError(f"saved key-input moments cover {len(saved)} layers, this "
                              f"control {len(self.sites)}")
        self.moments = [None if s is None else
                        s.to(device=site.key_stored().device, dtype=torch.float64).clone()
                        for s, site in zip(saved, self.sites, strict=True)]
        self._sum = [None] * len(self.sites)
        self._count = [0] * len(self.sites)
