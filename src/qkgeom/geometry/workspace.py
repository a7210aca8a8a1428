"""Reusable scratch buffers for the streaming analysis.

Why: every batch of a checkpoint analysis needs the same few multi-MB temporaries per
layer (centred activations, scaled queries, one block of attention scores). Fresh tensors
of that size are page-faulted in on every allocation on a CPU (glibc hands large blocks
back to the OS), which made allocation, not arithmetic, a large share of the analysis.
One :class:`Workspace` is shared by all layers of an analysis (they run one after
another); it holds the largest size asked for under each name, nothing more.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["Workspace"]


class Workspace:
    """Named flat buffers, grown on demand and handed out as views of the right shape.

    A buffer is valid until the next :meth:`get` of the same name; callers use distinct
    names for tensors that must coexist.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> Tensor:
        """An uninitialised contiguous tensor of ``shape`` backed by buffer ``name``."""
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            with torch.inference_mode(False):  # a normal tensor: usable in and out of it
                buf = torch.empty(n, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:n].view(shape)

    def clear(self) -> None:
        """Drop every buffer."""
        self._buffers.clear()
