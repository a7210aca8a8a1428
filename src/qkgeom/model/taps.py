"""Named taps on q and k, always removed (TransformerLens-style ``hook_q``/``hook_k``).

Probes need the per-head queries and keys exactly as attention sees them; the tap hands
them over without a second code path through the model, and the context manager
guarantees the model is left untouched even when a probe raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor

from qkgeom.model.gpt import GPT

LayerTap = Callable[[int, Tensor, Tensor], None]  # (layer, q, k), q/k (B, nh, T, hs)


@contextmanager
def tap_qk(model: GPT, fn: LayerTap) -> Iterator[None]:
    """Call ``fn(layer, q, k)`` for every attention layer during forwards in this block."""
    blocks = list(model.blocks)
    try:
        for i, block in enumerate(blocks):
            block.attn.tap = (lambda q, k, _i=i: fn(_i, q, k))
        yield
    finally:
        for block in blocks:
            block.attn.tap = None
