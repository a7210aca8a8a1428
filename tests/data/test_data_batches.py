"""sample_batch (seeded, resumable, shifted targets, in bounds) and the fixed probe set."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qkgeom.data import probe_set, sample_batch
from qkgeom.errors import QKGeomError


@pytest.fixture
def tokens(tmp_path: Path) -> np.memmap:
    """A read-only memmap whose token at position i is i (uint16), so windows reveal offsets."""
    path = tmp_path / "train.bin"
    np.arange(5000, dtype=np.uint16).tofile(path)
    return np.memmap(path, dtype=np.uint16, mode="r", shape=(5000,))


def test_shapes_dtype_and_shift(tokens):
    x, y = sample_batch(tokens, 8, 32, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    start = x[:, :1]
    assert torch.equal(x, start + torch.arange(32))  # a contiguous window of the corpus
    assert torch.equal(y, x + 1)  # next-token targets


def test_same_seed_same_batches_other_seed_differs(tokens):
    def draws(seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [sample_batch(tokens, 4, 16, g)[0] for _ in range(3)]

    a, b, c = draws(1), draws(1), draws(2)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(a, c, strict=True))
    assert not torch.equal(a[0], a[1])  # the generator advances


def test_restored_generator_state_continues_identically(tokens):
    g = torch.Generator().manual_seed(7)
    sample_batch(tokens, 4, 16, g)
    state = g.get_state()  # what a checkpoint saves
    expected = [sample_batch(tokens, 4, 16, g) for _ in range(3)]
    resumed = torch.Generator()
    resumed.set_state(state)
    for want, (x, y) in zip(
        expected, (sample_batch(tokens, 4, 16, resumed) for _ in range(3)), strict=True
    ):
        assert torch.equal(want[0], x) and torch.equal(want[1], y)


def test_offsets_cover_every_valid_window_and_stay_in_bounds(tokens):
    short = tokens[:19]  # block 16: valid offsets 0, 1, 2
    g = torch.Generator().manual_seed(0)
    starts = set()
    for _ in range(50):
        x, y = sample_batch(short, 8, 16, g)
        starts |= set(x[:, 0].tolist())
        assert int(y.max()) <= 18
    assert starts == {0, 1, 2}
    x, y = sample_batch(tokens[:17], 2, 16, g)  # exactly block_size + 1 tokens: one window
    assert torch.equal(x[0], torch.arange(16)) and torch.equal(y[1], torch.arange(1, 17))


def test_too_short_split(tokens):
    with pytest.raises(QKGeomError, match="too short for block_size 16"):
        sample_batch(tokens[:16], 2, 16, torch.Generator())
    with pytest.raises(QKGeomError, match="must be >= 1"):
        sample_batch(tokens, 0, 16, torch.Generator())


def test_probe_set_is_fixed_leading_windows(tokens):
    probe = probe_set(tokens, 4, 10)
    assert probe.shape == (4, 10) and probe.dtype == torch.int64
    assert torch.equal(probe, torch.arange(40).reshape(4, 10))  # contiguous, non-overlapping
    assert torch.equal(probe_set(tokens, 4, 10), probe)
    with pytest.raises(QKGeomError, match="fewer than the probe set's 4 x 10 = 40"):
        probe_set(tokens[:39], 4, 10)
