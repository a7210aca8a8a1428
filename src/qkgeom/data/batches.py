"""Training windows and the fixed probe set, read from memory-mapped token arrays.

Why: the data order must be a pure function of one ``torch.Generator`` (SPEC: one seed
per concern), so a seeded generator reproduces a run and its saved state resumes it
exactly; and only the sampled windows are read from the memmap, so memory does not grow
with the corpus. The probe set is the same held-out tokens for every run and checkpoint,
so geometry metrics at different steps and seeds are measured on identical inputs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from qkgeom.errors import QKGeomError

__all__ = ["sample_batch", "probe_set"]


def sample_batch(
    tokens: np.ndarray,
    batch_size: int,
    block_size: int,
    generator: torch.Generator,
    device: str | torch.device = "cpu",
) -> tuple[Tensor, Tensor]:
    """Random windows ``x`` and their next-token targets ``y``, both int64 of shape (B, T).

    Offsets are drawn with ``torch.randint(..., generator=generator)`` (a CPU generator),
    uniformly over every window that has a target: ``0 <= i <= len(tokens) - block_size - 1``.
    ``y[b, t] == tokens[i_b + t + 1]``, i.e. ``x`` shifted left by one.
    """
    if batch_size < 1 or block_size < 1:
        raise QKGeomError(
            f"batch_size and block_size must be >= 1 (got {batch_size}, {block_size})"
        )
    n = len(tokens)
    if n < block_size + 1:
        raise QKGeomError(
            f"split has {n:,} tokens, too short for block_size {block_size} (needs {block_size + 1}); "
            "use a smaller block_size or a larger corpus"
        )
    offsets = torch.randint(n - block_size, (batch_size,), generator=generator).tolist()  # (B,)
    windows = np.stack([np.asarray(tokens[i : i + block_size + 1]) for i in offsets])  # (B, T+1)
    windows_t = torch.from_numpy(windows.astype(np.int64))  # (B, T+1)
    x = windows_t[:, :-1].contiguous()  # (B, T)
    y = windows_t[:, 1:].contiguous()  # (B, T)
    device = torch.device(device)
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(
            device, non_blocking=True
        )
    return x.to(device), y.to(device)


def probe_set(tokens: np.ndarray, n_seq: int, block_size: int) -> Tensor:
    """The first ``n_seq * block_size`` tokens of a held-out split as (n_seq, block_size) int64.

    Contiguous, non-overlapping windows from the start of the split: no randomness, so
    every run and every checkpoint is probed on the same tokens.
    """
    if n_seq < 1 or block_size < 1:
        raise QKGeomError(
            f"probe set needs n_seq >= 1 and block_size >= 1 (got {n_seq}, {block_size})"
        )
    need = n_seq * block_size
    if len(tokens) < need:
        raise QKGeomError(
            f"held-out split has {len(tokens):,} tokens, fewer than the probe set's "
            f"{n_seq} x {block_size} = {need:,}; use fewer probe sequences or a larger corpus"
        )
    probe = np.asarray(tokens[:need]).astype(np.int64).reshape(n_seq, block_size)  # (N, T)
    return torch.from_numpy(probe)
