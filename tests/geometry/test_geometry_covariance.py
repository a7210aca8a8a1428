"""StreamingCovariance against torch.cov / numpy.cov and hand-known spectra."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkgeom.geometry import StreamingCovariance


def _feed(acc: StreamingCovariance, x: torch.Tensor, sizes: list[int]) -> None:
    assert sum(sizes) == x.shape[1]
    start = 0
    for n in sizes:
        acc.update(x[:, start : start + n])  # (G, n, dim)
        start += n


def test_matches_torch_and_numpy_cov_over_uneven_batches() -> None:
    x = torch.randn(3, 101, 5, generator=torch.Generator().manual_seed(0))  # (G, N, dim) float32
    acc = StreamingCovariance(3, 5)
    _feed(acc, x, [1, 7, 50, 0, 43])
    assert acc.count == 101
    cov = acc.covariance()  # (G, dim, dim) ddof = 1
    for g in range(3):
        ref = torch.cov(x[g].double().T)  # (dim, dim), correction = 1
        torch.testing.assert_close(cov[g], ref, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(
            cov[g].numpy(), np.cov(x[g].double().numpy(), rowvar=False), rtol=1e-12
        )
        np.testing.assert_allclose(
            acc.covariance(ddof=0)[g].numpy(),
            np.cov(x[g].double().numpy(), rowvar=False, bias=True),
            rtol=1e-12,
        )
    torch.testing.assert_close(acc.mean(), x.double().mean(dim=1), rtol=1e-12, atol=1e-14)


def test_internal_chunking_and_merge_do_not_change_the_result() -> None:
    x = torch.randn(2, 64, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    whole = StreamingCovariance(2, 4)
    whole.update(x)
    tiny_chunks = StreamingCovariance(2, 4, max_chunk_elements=8)  # one row per chunk
    tiny_chunks.update(x)
    left, right = StreamingCovariance(2, 4), StreamingCovariance(2, 4)
    left.update(x[:, :20])
    right.update(x[:, 20:])
    left.merge(right)
    for other in (tiny_chunks, left):
        assert other.count == 64
        torch.testing.assert_close(other.covariance(), whole.covariance(), rtol=1e-12, atol=1e-14)


def test_isotropic_gaussian_pr_close_to_dim() -> None:
    x = torch.randn(1, 20_000, 8, generator=torch.Generator().manual_seed(2))  # (1, N, 8)
    acc = StreamingCovariance(1, 8)
    _feed(acc, x, [5_000] * 4)
    assert float(acc.pr()[0]) == pytest.approx(8.0, abs=0.05)


def test_points_on_a_line_have_pr_one() -> None:
    g = torch.Generator().manual_seed(3)
    t = torch.randn(500, 1, generator=g, dtype=torch.float64)  # (N, 1)
    u = torch.randn(1, 6, generator=g, dtype=torch.float64)  # (1, dim) direction
    x = 3.0 + t * u  # (N, dim) affine line
    acc = StreamingCovariance(1, 6)
    acc.update(x)  # 2-D accepted when n_groups == 1
    assert float(acc.pr()[0]) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_large_offset_stays_accurate(dtype: torch.dtype) -> None:
    # Mean 1e4, unit spread: the textbook Σxxᵀ/n − μμᵀ loses ~8 digits here.
    noise = torch.randn(2, 3000, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    x = (1e4 + noise * torch.tensor([1.0, 0.5, 0.1], dtype=torch.float64)).to(dtype)  # (G, N, 3)
    acc = StreamingCovariance(2, 3)
    _feed(acc, x, [1000, 1, 999, 1000])
    for g in range(2):
        ref = torch.cov((x[g].double() - 1e4).T)  # exact shift (Sterbenz), then the reference
        torch.testing.assert_close(acc.covariance()[g], ref, rtol=1e-10, atol=1e-12)


def test_degenerate_cases() -> None:
    acc = StreamingCovariance(2, 3)
    with pytest.raises(ValueError, match="at least"):
        acc.pr()
    acc.update(torch.ones(2, 1, 3))
    assert acc.pr().tolist() == [0.0, 0.0]  # one sample: zero spectrum -> 0, not NaN
    with pytest.raises(ValueError, match="at least 2"):
        acc.covariance()  # ddof = 1 needs two samples
    with pytest.raises(ValueError, match="expected"):
        acc.update(torch.ones(3, 1, 3))
