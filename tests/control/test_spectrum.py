"""Spectrum reshaping: hand-solvable cases first, then random spectra, edges, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from qkgeom.control import apply_target, fit_spectrum, reshape_spectrum, spectral_reshape
from qkgeom.geometry.spectra import participation_ratio, weight_pr


def pr_sq(s: torch.Tensor) -> float:
    """Independent ground truth: the project's PR of the squared singular values."""
    return float(participation_ratio(s.double() ** 2))


def random_spectrum(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(n, generator=g, dtype=torch.float64)).sort(descending=True).values


# ------------------------------------------------------------------ hand-checkable truths


def test_two_values_solved_by_hand() -> None:
    # s = (2, 1): λ = (4, 1), PR = 25/17. For s' ∝ (2^γ, 1) the ratio r = λ2/λ1 = 4^-γ and
    # PR = (1 + r)² / (1 + r²). PR = 1.8 <=> 0.8 r² - 2 r + 0.8 = 0 <=> r = 1/2 <=> γ = 1/2,
    # so s' ∝ (√2, 1), rescaled to Σs'² = 5: s' = (√(10/3), √(5/3)).
    s = torch.tensor([2.0, 1.0], dtype=torch.float64)
    assert pr_sq(s) == pytest.approx(25 / 17, rel=1e-15)
    s_new, gamma = reshape_spectrum(s, 1.8)
    assert gamma == pytest.approx(0.5, rel=1e-10)
    torch.testing.assert_close(s_new, torch.tensor([math.sqrt(10 / 3), math.sqrt(5 / 3)],
                                                   dtype=torch.float64), rtol=1e-10, atol=0)
    # PR = 2 is the flat end: γ = 0, both values √2.5.
    s_flat, gamma0 = reshape_spectrum(s, 2.0)
    assert gamma0 == 0.0
    torch.testing.assert_close(s_flat, torch.full((2,), math.sqrt(2.5), dtype=torch.float64))


def test_target_equal_to_current_pr_gives_gamma_one_and_the_same_values() -> None:
    s = random_spectrum(20, 0)
    s_new, gamma = reshape_spectrum(s, pr_sq(s))
    assert gamma == 1.0
    assert torch.equal(s_new, s)


def test_gamma_grows_as_the_target_falls() -> None:
    s = random_spectrum(16, 1)
    pr0 = pr_sq(s)
    gammas = [reshape_spectrum(s, pr0 * f)[1] for f in (1.3, 1.1, 1.0, 0.8, 0.5, 0.2)]
    assert gammas == sorted(gammas)
    assert gammas[0] < 1 < gammas[-1]


# ------------------------------------------------------------------ random spectra


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("factor", [0.25, 0.6, 0.95, 1.05, 1.5])
def test_random_spectra_hit_the_target_and_keep_the_norm(seed: int, factor: float) -> None:
    n = [8, 17, 32, 64, 100, 128][seed]
    s = random_spectrum(n, seed)
    target = min(max(pr_sq(s) * factor, 1.05), n - 0.5)  # inside the reachable range
    s_new, gamma = reshape_spectrum(s, target)
    assert torch.isfinite(s_new).all() and math.isfinite(gamma) and gamma >= 0
    assert abs(pr_sq(s_new) - target) / target < 1e-9  # the invariant asks 1e-3
    assert abs(float((s_new ** 2).sum() / (s ** 2).sum()) - 1) < 1e-12
    # order of the singular values is kept (γ >= 0)
    assert bool((s_new[:-1] >= s_new[1:]).all())


def test_batched_rows_equal_one_at_a_time() -> None:
    s = torch.stack([random_spectrum(12, k) for k in range(5)])
    targets = torch.tensor([2.0, 4.0, 6.0, 8.0, 10.0], dtype=torch.float64)
    fit = fit_spectrum(s, targets)
    for k in range(5):
        one, gamma = reshape_spectrum(s[k], float(targets[k]))
        torch.testing.assert_close(fit.s[k], one, rtol=1e-12, atol=0)
        assert float(fit.gamma[k]) == pytest.approx(gamma, rel=1e-12)


def test_apply_target_keeps_singular_vectors_and_frobenius_norm() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 40, generator=g)  # float32, wide like a head slice
    target = float(weight_pr(w)) * 0.6
    w_new, info = apply_target(w, target)
    assert w_new.dtype == torch.float32 and w_new.shape == w.shape
    assert abs(float(weight_pr(w_new)) - target) / target < 1e-5  # float32 storage
    assert info["pr"] == pytest.approx(target, rel=1e-9) and not info["clamped"]
    assert abs(float(w_new.double().norm() / w.double().norm()) - 1) < 1e-6
    u0, _, vh0 = torch.linalg.svd(w.double(), full_matrices=False)
    u1, _, vh1 = torch.linalg.svd(w_new.double(), full_matrices=False)
    # same vectors up to sign: |<u0_i, u1_i>| = 1 for every i
    torch.testing.assert_close((u0 * u1).sum(0).abs(), torch.ones(24, dtype=torch.float64),
                               atol=1e-4, rtol=0)
    torch.testing.assert_close((vh0 * vh1).sum(1).abs(), torch.ones(24, dtype=torch.float64),
                               atol=1e-4, rtol=0)


def test_apply_target_returns_w_bit_for_bit_when_on_target() -> None:
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(4))
    w_new, info = apply_target(w, info_pr := pr_sq(torch.linalg.svdvals(w.double())))
    assert info["gamma"] == 1.0 and not info["changed"] and info_pr > 1
    assert torch.equal(w_new, w) and w_new.data_ptr() != w.data_ptr()


# ------------------------------------------------------------------ edges


def test_flat_spectrum_is_returned_unchanged_and_flagged() -> None:
    s = torch.full((6,), 0.7, dtype=torch.float64)
    fit = fit_spectrum(s, 3.0)  # unreachable: every power of a flat spectrum is flat
    assert bool(fit.flat) and bool(fit.clamped) and float(fit.gamma) == 1.0
    assert torch.equal(fit.s, s) and float(fit.pr) == pytest.approx(6.0)
    on = fit_spectrum(s, 6.0)  # its own PR: not a clamp
    assert bool(on.flat) and not bool(on.clamped)
    q = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(5)))[0]
    w_new, info = apply_target(q, 3.0)  # an orthogonal W (the orthogonal init)
    assert info["flat"] and info["clamped"] and torch.equal(w_new, q)


def test_rank_deficient_zeros_stay_zero_and_cap_the_reachable_pr() -> None:
    s = torch.tensor([3.0, 2.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    for target in (1.5, 2.9):
        s_new, _ = reshape_spectrum(s, target)
        assert torch.equal(s_new[3:], torch.zeros(2, dtype=torch.float64))
        assert pr_sq(s_new) == pytest.approx(target, rel=1e-9)
    fit = fit_spectrum(s, 4.5)  # above the 3 non-zero values: clamp to 3, γ = 0
    assert bool(fit.clamped) and float(fit.gamma) == 0.0 and float(fit.target) == 3.0
    torch.testing.assert_close(fit.s, torch.tensor([2.0, 2.0, 2.0, 0, 0], dtype=torch.float64)
                               * math.sqrt(14 / 12))
    # a rank-deficient matrix: the same through the SVD (tiny round-off values count as 0)
    g = torch.Generator().manual_seed(6)
    w = torch.randn(10, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 12, generator=g,
                                                                           dtype=torch.float64)
    w_new, info = apply_target(w, 5.0)
    assert info["clamped"] and info["target_used"] == pytest.approx(3.0)
    assert int(torch.linalg.matrix_rank(w_new)) == 3
    assert float(weight_pr(w_new)) == pytest.approx(3.0, rel=1e-9)


@pytest.mark.parametrize("target", [0.3, 1.0, -2.0, 0.0])
def test_target_below_one_clamps_to_the_rank_one_limit(target: float) -> None:
    s = random_spectrum(9, 7)
    fit = fit_spectrum(s, target)
    assert math.isinf(float(fit.gamma)) and float(fit.pr) == pytest.approx(1.0)
    assert bool(fit.clamped) == (target != 1.0)
    assert torch.isfinite(fit.s).all()
    assert int((fit.s > 0).sum()) == 1  # only the largest survives, carrying the whole norm
    assert float(fit.s[0]) == pytest.approx(float(s.norm()), rel=1e-12)


def test_target_above_n_clamps_to_the_flat_end() -> None:
    s = random_spectrum(9, 8)
    fit = fit_spectrum(s, 50.0)
    assert bool(fit.clamped) and float(fit.gamma) == 0.0 and float(fit.pr) == pytest.approx(9.0)
    assert torch.isfinite(fit.s).all()


def test_all_zero_spectrum_and_bad_input() -> None:
    fit = fit_spectrum(torch.zeros(4), 2.0)
    assert bool(fit.flat) and bool(fit.clamped) and float(fit.pr) == 0.0
    assert torch.equal(fit.s, torch.zeros(4, dtype=torch.float64))
    for bad in (torch.tensor([1.0, -0.1]), torch.tensor([1.0, math.nan]), torch.tensor([])):
        with pytest.raises(ValueError):
            fit_spectrum(bad, 1.5)
    with pytest.raises(ValueError, match="NaN"):
        fit_spectrum(torch.tensor([2.0, 1.0]), math.nan)


# ------------------------------------------------------------------ the differentiable version


def reference(w: torch.Tensor, tau: float) -> torch.Tensor:
    """Autograd through torch.linalg.svd (valid for distinct singular values) with the
    implicit derivative of γ: an independent route to the same gradient."""
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    g0 = fit_spectrum(s.detach(), tau).gamma

    def pr(s_: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        p = s_ ** (2 * g)
        return p.sum() ** 2 / (p * p).sum()

    g_req = g0.clone().requires_grad_(True)
    (dpr,) = torch.autograd.grad(pr(s.detach(), g_req), g_req)
    gamma = g0 - (pr(s, g0) - tau) / dpr
    psi = torch.sqrt((s ** 2).sum() / (s ** (2 * gamma)).sum()) * s ** gamma
    return (u * psi) @ vh


@pytest.mark.parametrize("shape", [(6, 4), (3, 8), (5, 5)])
def test_gradient_matches_autograd_through_the_svd(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=g, dtype=torch.float64)
    ct = torch.randn(*shape, generator=g, dtype=torch.float64)
    tau = float(weight_pr(w)) * 0.75
    w1 = w.clone().requires_grad_(True)
    out1 = spectral_reshape(w1[None], tau)[0][0]
    (out1 * ct).sum().backward()
    w2 = w.clone().requires_grad_(True)
    (reference(w2, tau) * ct).sum().backward()
    torch.testing.assert_close(out1.detach(), reference(w, tau), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-8, atol=1e-10)


def test_gradcheck_and_finite_gradient_at_repeated_singular_values() -> None:
    g = torch.Generator().manual_seed(9)
    w = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    tau = float(weight_pr(w.detach())) * 0.8
    assert torch.autograd.gradcheck(lambda x: spectral_reshape(x[None], tau)[0], (w,))
    # repeated singular values (not flat): autograd through torch's SVD is NaN here
    u = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    a = ((u * torch.tensor([3.0, 2, 2, 2, 1, 0.5], dtype=torch.float64)) @ v.T)
    a.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: spectral_reshape(x[None], 3.0)[0], (a,))
    # flat (orthogonal W): passed through with an identity gradient
    q = (u * 0.3).requires_grad_(True)
    out = spectral_reshape(q[None], 4.0)[0]
    ct = torch.randn(1, 6, 6, generator=g, dtype=torch.float64)
    (out * ct).sum().backward()
    torch.testing.assert_close(q.grad, ct[0])
