"""Padded batches: an ``attention_mask`` turned into right-padded windows and their lengths.

Why: padded, masked batches are the normal input of BERT-style and most fine-tuning work,
but every token metric is defined per sequence, on its real tokens alone (a padded
sequence must give the numbers it gives unpadded). So each row's real tokens are moved
to the front (left padding becomes right padding: every sequence starts at position 0, as
it would alone), and the measurement is told each row's number of real tokens
(:meth:`~qkgeom.geometry.tokens.LayerGeometry.update` ``lengths=``). After that move a
causal model needs no mask at all (a real token never sees the padding after it); an
encoder gets the moved mask, so its real tokens never attend to padding.

A row's real tokens must be one contiguous run (left or right padding); a mask of all ones
is no padding, and the caller then takes the unpadded path unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkgeom.errors import QKGeomError

__all__ = ["Padded", "check_mask", "right_padded"]


@dataclass(frozen=True)
class Padded:
    """A padded batch moved to right padding.

    ``ids`` (B, T): each row's real tokens first; ``mask`` (B, T) bool: ``True`` on the
    real tokens (positions ``0 .. lengths[b]−1``); ``lengths`` (B,) int64, and its list.
    """

    ids: Tensor
    mask: Tensor
    lengths: Tensor
    sizes: tuple[int, ...]

    @property
    def tokens(self) -> int:
        """Real tokens of the batch."""
        return sum(self.sizes)


def check_mask(ids: Tensor, mask: object) -> Tensor | None:
    """``mask`` as a (B, T) bool tensor, or None when it pads nothing (None or all ones).

    Raises a one-line :class:`QKGeomError` unless it has the shape of ``ids``, holds only
    0/1, gives every row at least one real token and each row's real tokens in one
    contiguous run (left or right padding).
    """
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
