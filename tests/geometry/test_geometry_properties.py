"""Property tests: PR bounds, invariances, and the covariance route on random inputs."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkgeom.geometry import participation_ratio, pr_from_covariance, weight_pr

FAST = settings(max_examples=60, deadline=None)

# Zeros or values in [1e-6, 1e6]: scaling by 1e±100 below then never leaves float64's range.
entries = st.one_of(st.just(0.0), st.floats(1e-6, 1e6))
spectra = st.lists(entries, min_size=1, max_size=24)


@FAST
@given(spectra)
def test_pr_is_within_one_and_n(lam: list[float]) -> None:
    pr = float(participation_ratio(torch.tensor(lam, dtype=torch.float64)))
    if max(lam) == 0:
        assert pr == 0.0
    else:
        assert 1.0 - 1e-12 <= pr <= len(lam) + 1e-9
        n_pos = sum(v > 0 for v in lam)
        assert pr <= n_pos + 1e-9  # zeros add nothing


@FAST
@given(spectra, st.floats(-100, 100))
def test_pr_is_scale_and_permutation_invariant(lam: list[float], log10_c: float) -> None:
    t = torch.tensor(lam, dtype=torch.float64)
    base = float(participation_ratio(t))
    scaled = float(participation_ratio(t * 10.0**log10_c))
    flipped = float(participation_ratio(t.flip(0)))
    assert abs(scaled - base) <= 1e-12 * max(base, 1.0)
    assert abs(flipped - base) <= 1e-12 * max(base, 1.0)


@FAST
@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(1, 6))
def test_covariance_and_weight_routes_agree_with_eigen_svd(seed: int, m: int, n: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, n, generator=g, dtype=torch.float64)  # (m, n)
    sv2 = torch.linalg.svdvals(w) ** 2  # (min(m, n),)
    expected = float(participation_ratio(sv2))
    assert abs(float(weight_pr(w)) - expected) <= 1e-9 * expected
    assert abs(float(pr_from_covariance(w @ w.T)) - expected) <= 1e-9 * expected
    assert 1.0 - 1e-9 <= expected <= min(m, n) + 1e-9
