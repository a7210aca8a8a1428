"""Reusable scratch buffers for the streaming measurement.

Why: on a CPU, fresh multi-MB temporaries are page-faulted in on every batch, which made
allocation, not arithmetic, a large share of an analysis. One :class:`Workspace` is shared by
all layers of a measurement; it keeps the largest size asked for under each name.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["Workspace"]


class Workspace:
    """Named flat buffers handed out as views; one is valid until the next :meth:`get` of its
    name."""

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
