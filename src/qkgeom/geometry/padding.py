"""Padded batches: an ``attention_mask`` turned into right-padded windows and their lengths.

Why: every token metric is defined per sequence on its real tokens, so a padded sequence must
give the numbers it gives alone. Each row's real tokens (one contiguous run) are moved to the
front and the measurement is told each length; a causal model then needs no mask
(docs/definitions.md#probe-set, "Padded probe batches").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkgeom.errors import QKGeomError

__all__ = ["Padded", "check_mask", "right_padded"]


@dataclass(frozen=True)
class Padded:
    """A batch moved to right padding: ``ids`` (B, T) real tokens first, ``mask`` (B, T) bool,
    ``lengths`` (B,) int64 and the same as ``sizes``."""

    ids: Tensor
    mask: Tensor
    lengths: Tensor
    sizes: tuple[int, ...]

    @property
    def tokens(self) -> int:
        """Real tokens of the batch."""
        return sum(self.sizes)


def check_mask(ids: Tensor, mask: object) -> Tensor | None:
    """``mask`` as a (B, T) bool tensor, or None when it pads nothing; a one-line QKGeomError
    unless it is shaped like ``ids``, holds only 0/1 and gives every row one run of real
    tokens."""
    if mask is None:
        return None
    try:
        m = torch.as_tensor(mask)
    except (TypeError, ValueError, RuntimeError):
        raise QKGeomError(f"attention_mask must be a 0/1 array shaped like input_ids, got a "
                          f"{type(mask).__name__}") from None
    if m.ndim == 1 and ids.ndim == 2 and ids.shape[0] == 1:
        m = m[None]
    if tuple(m.shape) != tuple(ids.shape):
        raise QKGeomError(f"attention_mask has shape {tuple(m.shape)}, input_ids "
                          f"{tuple(ids.shape)}: they must match")
    if m.is_complex() or not bool(((m == 0) | (m == 1)).all()):
        raise QKGeomError("attention_mask must hold only 0 (padding) and 1 (real token)")
    m = m.to("cpu", torch.bool)
    if bool(m.all()):
        return None
    lengths = m.sum(dim=1)
    if bool((lengths == 0).any()):
        row = int((lengths == 0).nonzero()[0, 0])
        raise QKGeomError(f"attention_mask row {row} has no real token; drop empty sequences")
    # one run of ones per row: the mask changes value at most twice along the row, and a
    # row starting and ending with padding has its ones in between
    edges = (m[:, 1:] != m[:, :-1]).sum(dim=1) if m.shape[1] > 1 else torch.zeros_like(lengths)
    gappy = (edges > 2) | ((edges == 2) & m[:, 0])
    if bool(gappy.any()):
        row = int(gappy.nonzero()[0, 0])
        raise QKGeomError(f"attention_mask row {row} has padding between real tokens; only "
                          "left or right padding (one run of real tokens per row) is measured")
    return m


def right_padded(ids: Tensor, mask: Tensor) -> Padded:
    """Move each row's real tokens (``mask``, from :func:`check_mask`) to the front."""
    B, T = ids.shape
    mask = mask.to(ids.device)
    lengths = mask.sum(dim=1)  # (B,)
    start = mask.to(torch.int8).argmax(dim=1)  # (B,) first real token
    idx = (torch.arange(T, device=ids.device)[None] + start[:, None]) % T  # (B, T)
    moved = torch.gather(ids, 1, idx)
    real = torch.arange(T, device=ids.device)[None] < lengths[:, None]
    return Padded(moved, real, lengths.cpu(), tuple(int(n) for n in lengths.tolist()))
