"""Training windows and the fixed probe set, read from memory-mapped token arrays.

The data order is a pure function of one ``torch.Generator``, so a seed reproduces a run
and its saved state resumes it exactly; only the sampled windows are read from the memmap.
The probe set is the same held-out tokens for every run and checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from qkgeom.errors import QKGeomError

__all__ = ["sample_batch", "probe_set", "BatchStream"]


def sample_batch(
    tokens: np.ndarray,
    batch_size: int,
    block_size: int,
    generator: torch.Generator,
    device: str | torch.device = "cpu",
) -> tuple[Tensor, Tensor]:
    """Random windows ``x`` (B, T) int64 and their next-token targets ``y`` (``x`` shifted
    left by one), at offsets drawn uniformly by ``torch.randint(generator=generator)`` over
    every window that has a target."""
    if batch_size < 1 or block_size < 1:
        raise QKGeomError(f"batch_size and block_size must be >= 1 (got {batch_size}, "
                          f"{block_size})")
    n = len(tokens)
    if n < block_size + 1:
        raise QKGeomError(f"split has {n:,} tokens, too short for block_size {block_size} "
                          f"(needs {block_size + 1}); use a smaller block_size or a larger corpus")
    offsets = torch.randint(n - block_size, (batch_size,), generator=generator).tolist()  # (B,)
    windows = np.stack([np.asarray(tokens[i : i + block_size + 1]) for i in offsets])  # (B, T+1)
    windows_t = torch.from_numpy(windows.astype(np.int64))  # (B, T+1)
    x = windows_t[:, :-1].contiguous()  # (B, T)
    y = windows_t[:, 1:].contiguous()  # (B, T)
    device = torch.device(device)
    if device.type == "cuda":
        return (x.pin_memory().to(device, non_blocking=True),
                y.pin_memory().to(device, non_blocking=True))
    return x.to(device), y.to(device)


class BatchStream:
    """The training batches of one run in data order, with ``prefetch`` (CUDA) drawn one
    step ahead so their copy overlaps the current step. The batches are the same either
    way, and :meth:`generator_state` is the state before any batch drawn ahead, so a
    checkpoint resumes at the batch the next step uses."""

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int,
                 generator: torch.Generator, device: str | torch.device = "cpu",
                 prefetch: bool = False) -> None:
        self.tokens, self.batch_size, self.block_size = tokens, batch_size, block_size
        self.generator, self.device, self.prefetching = generator, torch.device(device), prefetch
        self._ahead: tuple[Tensor, Tensor, Tensor] | None = None  # (x, y, state before them)

    def _draw(self) -> tuple[Tensor, Tensor, Tensor]:
        before = self.generator.get_state()
        x, y = sample_batch(self.tokens, self.batch_size, self.block_size, self.generator,
                            device=self.device)
        return x, y, before

    def next(self) -> tuple[Tensor, Tensor]:
        """The batch for the next step: ``x``, ``y`` of shape (B, T) on the device."""
        x, y, _ = self._ahead if self._ahead is not None else self._draw()
        self._ahead = None
        return x, y

    def prefetch(self) -> None:
        """Draw the following batch now (no-op unless prefetching, or already drawn)."""
        if self.prefetching and self._ahead is None:
            self._ahead = self._draw()

    def generator_state(self) -> Tensor:
        """The data generator's state as of the first batch not yet returned by next()."""
        return self._ahead[2] if self._ahead is not None else self.generator.get_state()


def probe_set(tokens: np.ndarray, n_seq: int, block_size: int) -> Tensor:
    """The first ``n_seq * block_size`` tokens of a held-out split as (n_seq, block_size)
    int64: no randomness, so every run and checkpoint is probed on the same tokens."""
    if n_seq < 1 or block_size < 1:
        raise QKGeomError(f"probe set needs n_seq >= 1 and block_size >= 1 (got {n_seq}, "
                          f"{block_size})")
    need = n_seq * block_size
    if len(tokens) < need:
        raise QKGeomError(f"held-out split has {len(tokens):,} tokens, fewer than the probe "
                          f"set's {n_seq} x {block_size} = {need:,}; use fewer probe sequences "
                          "or a larger corpus")
    probe = np.asarray(tokens[:need]).astype(np.int64).reshape(n_seq, block_size)  # (N, T)
    return torch.from_numpy(probe)
