"""Reshaping a singular spectrum to a target participation ratio, as pure functions.

``s′ᵢ = c·sᵢ^γ``: the singular vectors and the order of the values stay, ``c`` keeps
``Σs′² = Σs²`` and γ ≥ 0 is searched so that ``PR(s′²)`` is the target (PR falls
monotonically in γ, so the root is unique). The edge cases (zero, tied and flat spectra,
unreachable targets) are defined in docs/control.md#the-spectrum-fit: never a silent NaN.
:func:`spectral_reshape` is the differentiable version of the ``parametrize`` control.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from qkgeom.geometry.spectra import NonFiniteError, pr_of_sums

__all__ = ["GAMMA_MAX", "SpectrumFit", "apply_target", "default_rtol", "fit_spectrum",
           "reshape_spectrum", "spectral_reshape"]

GAMMA_MAX = 2.0**40  # largest finite γ tried; beyond it only the γ = inf limit is used
_GAMMA_RTOL = 1e-13  # search stop: relative size of the last step (or bracket) on γ
_SAME_RTOL = 1e-12  # a target this close to the current PR means "leave it" (γ = 1)


class SpectrumFit(NamedTuple):
    """Result of :func:`fit_spectrum`, batched over the leading dims (docs/control.md)."""

    s: Tensor  # (..., n) reshaped singular values, float64
    gamma: Tensor  # 1 unchanged, 0 flattened, inf the rank-m_top limit
    target: Tensor  # the PR aimed at, after clamping to the reachable range
    pr: Tensor  # PR(s′²) achieved
    pr_before: Tensor  # PR(s²)
    clamped: Tensor  # the target was out of reach (or the spectrum could not move)
    flat: Tensor  # flat or all-zero input, returned unchanged


def _pr_rows(p: Tensor) -> Tensor:
    """PR of non-negative rows whose max is 1 (so no overflow); 0.0 for an all-zero row."""
    return pr_of_sums(p.sum(dim=-1), (p * p).sum(dim=-1))


def _powers(logx: Tensor, nz: Tensor, gamma: Tensor) -> Tensor:
    """``x^γ`` on the non-zero entries (x = s/s_max, so the top entry is 1), 0 elsewhere."""
    return torch.where(nz, torch.exp(gamma.unsqueeze(-1) * logx), torch.zeros_like(logx))


def _pr_at(logx: Tensor, nz: Tensor, gamma: Tensor) -> Tensor:
    """PR(s′²) for s′ ∝ s^γ, i.e. PR of x^(2γ)."""
    return _pr_rows(_powers(logx, nz, 2 * gamma))


def _bisect_gamma(logx: Tensor, nz: Tensor, t: Tensor, below: Tensor,
                  active: Tensor) -> Tensor:
    """γ with PR(s^2γ) = t for the ``active`` rows: Newton steps on log PR − log t inside
    a bracket that every evaluation shrinks, bisection where a step would leave it, so it
    is as robust as bisection and quadratic near the root. The bracket is [0, 1], or one
    octave of [1, 2^40] when the target is ``below`` the current PR; γ = 1 starts it when
    inside (the control's per-step corrections are small)."""
    lo = torch.where(below, torch.ones_like(t), torch.zeros_like(t))  # (...,)
    hi = torch.ones_like(t)
    if bool(below.any()):
        octaves = 2.0 ** torch.arange(41, dtype=t.dtype, device=t.device)  # 1 .. GAMMA_MAX
        pr_oct = _pr_at(logx.unsqueeze(-2), nz.unsqueeze(-2), octaves.expand(*t.shape, 41))
        j = (pr_oct > t.unsqueeze(-1)).sum(-1).clamp(1, 40)  # first octave with PR <= t
        lo = torch.where(below, octaves[j - 1], lo)
        hi = torch.where(below, octaves[j], hi)
    gamma = torch.where((lo <= 1) & (hi >= 1), torch.ones_like(t), (lo + hi) / 2)
    log_t = torch.log(t.clamp_min(1e-300))
    ell = torch.where(nz, logx, torch.zeros_like(logx))
    done = ~active
    for _ in range(200):
        p2 = _powers(logx, nz, 2 * gamma)
        p4 = p2 * p2
        s2, s4 = p2.sum(-1), p4.sum(-1)  # >= 1: the top entry is x = 1
        f = 2 * torch.log(s2) - torch.log(s4) - log_t  # > 0 <=> PR(γ) > t <=> root above γ
        fp = 4 * ((ell * p2).sum(-1) / s2 - (ell * p4).sum(-1) / s4)  # d f / dγ <= 0
        lo = torch.where(~done & (f > 0), gamma, lo)
        hi = torch.where(~done & (f <= 0), gamma, hi)
        newton = gamma - f / torch.where(fp < 0, fp, -torch.ones_like(fp))
        inside = (fp < 0) & (newton >= lo) & (newton <= hi)
        exact = f == 0  # on the root already: stay
        step_to = torch.where(exact, gamma, torch.where(inside, newton, (lo + hi) / 2))
        small = (step_to - gamma).abs() <= _GAMMA_RTOL * step_to.abs().clamp_min(1e-300)
        narrow = (hi - lo) <= torch.clamp(_GAMMA_RTOL * hi, min=1e-300)
        gamma = torch.where(done, gamma, step_to)
        done = done | small | narrow | exact
        if bool(done.all()):
            break
    return gamma


def _check_spectrum(s: Tensor | Any) -> Tensor:
    s = torch.as_tensor(s).to(torch.float64)
    if s.ndim == 0 or s.shape[-1] == 0:
        raise ValueError(f"a spectrum needs a non-empty last dim, got shape {tuple(s.shape)}")
    if not bool(torch.isfinite(s).all()):  # the keys diverged: the trainer records it so
        raise NonFiniteError("the singular values contain NaN or inf")
    if bool((s < 0).any()):
        raise ValueError(f"singular values must be non-negative; min = {s.min().item():.3g}")
    return s


def default_rtol(n: int, dtype: torch.dtype = torch.float64) -> float:
    """Relative tolerance for "zero" and "tied" singular values of an n-value spectrum
    whose matrix is stored in ``dtype``: ``min(8·n·eps(dtype), 1e-3)``."""
    return min(8 * n * torch.finfo(dtype).eps, 1e-3)


def fit_spectrum(s: Tensor | Any, target_pr: Tensor | float, *,
                 rtol: float | None = None) -> SpectrumFit:
    """Reshape singular values ``s`` (..., n) to ``PR(s′²) = target_pr`` (broadcast over
    the leading dims). Zero entries may pad rows of different lengths: they stay zero and
    do not count. ``rtol``: zero / tied values (default :func:`default_rtol`, float64)."""
    s = _check_spectrum(s)  # (..., n)
    rtol = default_rtol(s.shape[-1]) if rtol is None else float(rtol)
    target = torch.as_tensor(target_pr, dtype=torch.float64, device=s.device)
    target = target.expand(s.shape[:-1]).clone()  # (...,)
    if bool(torch.isnan(target).any()):
        raise ValueError("target PR is NaN")
    s_max = s.amax(dim=-1)  # (...,)
    dead = s_max == 0  # all-zero rows
    x = s / torch.where(dead, torch.ones_like(s_max), s_max).unsqueeze(-1)  # (..., n) in [0, 1]
    nz = x > rtol  # non-zero singular values
    logx = torch.where(nz, torch.log(torch.where(nz, x, torch.ones_like(x))), torch.zeros_like(x))
    n_nz = nz.sum(dim=-1).to(torch.float64)  # = PR at γ = 0
    top = nz & (x >= 1 - rtol)  # values tied for the maximum
    m_top = top.sum(dim=-1).to(torch.float64)  # = PR as γ -> inf
    flat = dead | (m_top == n_nz)
    ones = torch.ones_like(s_max)
    pr_before = _pr_at(logx, nz, ones)  # PR(s²)
    pr_cap = _pr_at(logx, nz, ones * GAMMA_MAX)  # PR at the largest finite γ
    # the reachable range [m_top, n_nz]: clamp, and decide the closed-form rows first
    t = torch.minimum(torch.maximum(target, m_top), n_nz)
    same = (target - pr_before).abs() <= _SAME_RTOL * pr_before
    at_top = (t >= n_nz) & ~same  # γ = 0
    at_limit = (t <= m_top) & ~same  # γ = inf
    beyond_cap = (t < pr_cap) & ~at_limit & ~same  # γ = GAMMA_MAX, PR just above the target
    clamped = ((t - target).abs() > _SAME_RTOL * target.abs().clamp_min(1.0)) | beyond_cap
    solve = ~(flat | same | at_top | at_limit | beyond_cap)
    gamma = ones.clone()
    if bool(solve.any()):
        gamma = torch.where(solve, _bisect_gamma(logx, nz, t, t < pr_before, solve), gamma)
    gamma = torch.where(at_top, torch.zeros_like(gamma), gamma)
    gamma = torch.where(beyond_cap, torch.full_like(gamma, GAMMA_MAX), gamma)
    gamma = torch.where(at_limit & ~flat, torch.full_like(gamma, math.inf), gamma)
    keep = flat | same
    gamma = torch.where(keep, ones, gamma)
    s_new, pr_new = _rescaled(x, logx, nz, top, s_max, gamma)
    t = torch.where(flat, pr_before, torch.where(same, target, t))
    clamped = torch.where(flat, dead | ((target - n_nz).abs() > _SAME_RTOL * n_nz), clamped)
    return SpectrumFit(s=torch.where(keep.unsqueeze(-1), s, s_new), gamma=gamma,
                       target=torch.where(beyond_cap, pr_cap, t),
                       pr=torch.where(keep, pr_before, pr_new), pr_before=pr_before,
                       clamped=clamped, flat=flat)


def _rescaled(x: Tensor, logx: Tensor, nz: Tensor, top: Tensor, s_max: Tensor,
              gamma: Tensor) -> tuple[Tensor, Tensor]:
    """(s′ = c·s^γ with Σs′² = Σs², PR(s′²)), computed on x = s/s_max (no overflow for any
    γ); γ = inf is the limit: the values tied for the top equal, the rest zero."""
    inf = torch.isinf(gamma)
    p = _powers(logx, nz, torch.where(inf, torch.ones_like(gamma), gamma))  # (..., n)
    p = torch.where(inf.unsqueeze(-1), top.to(p.dtype), p)
    sum_x2 = (x * x).sum(dim=-1)  # includes values treated as zero: the norm is kept exactly
    sum_p2 = (p * p).sum(dim=-1).clamp_min(1.0)  # the top entry is 1, so >= 1 unless dead
    return p * (s_max * torch.sqrt(sum_x2 / sum_p2)).unsqueeze(-1), _pr_rows(p * p)


def reshape_spectrum(s: Tensor | Any, target_pr: Tensor | float, *,
                     rtol: float | None = None) -> tuple[Tensor, Any]:
    """``(s_new, gamma)`` of :func:`fit_spectrum` for singular values (not their squares)
    ``s``, (n,) (``gamma`` a float) or (..., n); the fit has the flags."""
    fit = fit_spectrum(s, target_pr, rtol=rtol)
    if fit.s.ndim == 1:
        return fit.s, float(fit.gamma)
    return fit.s, fit.gamma


def _svd_reshape(a: Tensor, target: Tensor,
                 rtol: float) -> tuple[Tensor, SpectrumFit, tuple[Tensor, ...]]:
    """float64 (..., m, n) -> reshaped matrices, the fit, and (U, s, Vh)."""
    u, s, vh = torch.linalg.svd(a, full_matrices=False)  # (..., m, k), (..., k), (..., k, n)
    fit = fit_spectrum(s, target, rtol=rtol)
    out = (u * fit.s.unsqueeze(-2)) @ vh  # (..., m, n)
    keep = (fit.flat | (fit.gamma == 1)).unsqueeze(-1).unsqueeze(-1)
    return torch.where(keep, a, out), fit, (u, s, vh)


def apply_target(w: Tensor, target_pr: Tensor | float) -> tuple[Tensor, dict[str, Any]]:
    """(new ``w``, info): the spectrum of ``w`` (m, n) or (..., m, n) reshaped to PR =
    target through a float64 SVD, in ``w``'s dtype (bit for bit ``w`` where nothing
    changes). ``info``: target, target_used (clamped), pr_before, pr, gamma, clamped, flat,
    changed; floats and bools for one matrix, tensors for a batch."""
    if w.ndim < 2:
        raise ValueError(f"apply_target needs (..., m, n), got {tuple(w.shape)}")
    a = w.detach().to(torch.float64)
    target = torch.as_tensor(target_pr, dtype=torch.float64, device=w.device)
    rtol = default_rtol(min(w.shape[-2:]), w.dtype)
    new64, fit, _ = _svd_reshape(a, target.expand(a.shape[:-2]), rtol)
    changed = ~(fit.flat | (fit.gamma == 1))  # (...,)
    new = torch.where(changed.unsqueeze(-1).unsqueeze(-1), new64.to(w.dtype), w.detach())
    info: dict[str, Any] = {
        "target": torch.as_tensor(target_pr, dtype=torch.float64).expand(a.shape[:-2]),
        "target_used": fit.target, "pr_before": fit.pr_before, "pr": fit.pr,
        "gamma": fit.gamma, "clamped": fit.clamped, "flat": fit.flat, "changed": changed,
    }
    if w.ndim == 2:
        info = {k: (bool(v) if v.dtype == torch.bool else float(v)) for k, v in info.items()}
    return new.clone(), info


# --------------------------------------------------------------------------- differentiable


def _psi_live(s: Tensor, gamma0: Tensor, target: Tensor, nz: Tensor, top: Tensor,
              implicit: Tensor, limit: Tensor, ghat_diag: Tensor) -> Tensor:
    """``Σⱼ Ĝⱼⱼ·ψⱼ`` (ψⱼ = c(s)·sⱼ^γ(s)) with the explicit sⱼ frozen and only c(s) and γ(s)
    live: γ follows the target by the implicit function theorem where ``implicit`` (one
    Newton correction around the solved γ₀), else it is held; ``limit`` rows (γ = inf) use
    ψ = ‖s‖·1[top]/√m_top. Finite in every branch."""
    s_max = s.detach().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(s.dtype).tiny)
    xs = s / s_max  # (B, k), live; the constant s_max cancels in ψ / s_max
    l_live = torch.where(nz, torch.log(torch.where(nz, xs, torch.ones_like(xs))), 0 * xs)
    l_frozen = l_live.detach()
    g0 = torch.where(torch.isfinite(gamma0), gamma0, torch.ones_like(gamma0))  # (B,)
    neg_inf = torch.full_like(l_live, -math.inf)

    def lse(a: Tensor, logs: Tensor) -> Tensor:  # log Σ_nz x^a, a: (B,)
        return torch.logsumexp(torch.where(nz, a.unsqueeze(-1) * logs, neg_inf), dim=-1)

    # dPR/dγ at the solution, held constant (only its value enters the implicit derivative).
    with torch.no_grad():
        w2 = torch.softmax(torch.where(nz, 2 * g0.unsqueeze(-1) * l_frozen, neg_inf), dim=-1)
        w4 = torch.softmax(torch.where(nz, 4 * g0.unsqueeze(-1) * l_frozen, neg_inf), dim=-1)
        log_pr0 = 2 * lse(2 * g0, l_frozen) - lse(4 * g0, l_frozen)
        dpr = torch.exp(log_pr0) * 4 * ((w2 * l_frozen).sum(-1) - (w4 * l_frozen).sum(-1))
        use_imp = implicit & (dpr.abs() > 1e-12)
        dpr = torch.where(use_imp, dpr, torch.ones_like(dpr))
    pr_live = torch.exp(2 * lse(2 * g0, l_live) - lse(4 * g0, l_live))  # PR(s, γ₀), live in s
    g_imp = g0 - (pr_live - target) / dpr
    gamma = torch.where(use_imp, g_imp, g0)  # (B,)
    log_norm2 = torch.logsumexp(torch.where(nz, 2 * l_live, neg_inf), dim=-1)  # log Σx²
    log_c = 0.5 * (log_norm2 - lse(2 * gamma, l_live))  # (B,)
    psi = torch.where(nz, torch.exp(log_c.unsqueeze(-1) + gamma.unsqueeze(-1) * l_frozen),
                      0 * xs)  # ψ / s_max, (B, k)
    m_top = top.sum(-1, keepdim=True).clamp_min(1).to(xs.dtype)
    psi_lim = torch.where(top, torch.exp(0.5 * log_norm2).unsqueeze(-1) / m_top.sqrt(), 0 * xs)
    psi = torch.where(limit.unsqueeze(-1), psi_lim, psi)
    return (ghat_diag * psi * s_max).sum()


class _SpectralReshape(torch.autograd.Function):
    """float64 (B, m, n) -> U·diag(ψ(s))·Vᵀ, with a backward that is finite for repeated s."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, target: Tensor, identity: Tensor,
                rtol: float) -> tuple[Tensor, ...]:
        out, fit, (u, s, vh) = _svd_reshape(a, target, rtol)
        ctx.rtol = rtol
        ident = identity | fit.flat  # (B,) passed through, identity gradient
        out = torch.where(ident.unsqueeze(-1).unsqueeze(-1), a, out)
        ctx.save_for_backward(u, s, vh, fit.s, fit.gamma, fit.target, ident, fit.clamped)
        ctx.mark_non_differentiable(fit.gamma, fit.pr, fit.clamped)
        return out, fit.gamma, fit.pr, fit.clamped

    @staticmethod
    def backward(ctx: Any, g: Tensor, *_: Any) -> tuple[Tensor | None, None, None, None]:
        u, s, vh, psi, gamma, target, ident, clamped = ctx.saved_tensors
        v = vh.mT  # (B, n, k)
        s_max = s.amax(dim=-1, keepdim=True)  # (B, 1)
        nz = s > ctx.rtol * s_max  # (B, k), as in fit_spectrum
        top = nz & (s >= (1 - ctx.rtol) * s_max)
        limit = torch.isinf(gamma)  # (B,)
        g_fin = torch.where(limit, torch.zeros_like(gamma), gamma)
        s_safe = torch.where(nz, s, torch.ones_like(s))
        ratio = torch.where(nz, psi / s_safe, torch.zeros_like(s))  # ψᵢ/sᵢ
        dpsi = torch.where(nz, g_fin.unsqueeze(-1) * ratio, torch.zeros_like(s))  # ψ'(sᵢ), c and γ held
        # Divided differences (ψᵢ−ψⱼ)/(sᵢ−sⱼ) -> ψ' for (nearly) equal values; (ψᵢ+ψⱼ)/(sᵢ+sⱼ).
        ds = s.unsqueeze(-1) - s.unsqueeze(-2)  # (B, k, k)
        close = ds.abs() <= 1e-8 * s_max.unsqueeze(-1)
        d1 = torch.where(close, (dpsi.unsqueeze(-1) + dpsi.unsqueeze(-2)) / 2,
                         (psi.unsqueeze(-1) - psi.unsqueeze(-2)) / torch.where(close, 1.0, ds))
        ssum = s.unsqueeze(-1) + s.unsqueeze(-2)
        pos = ssum > 0
        d2 = torch.where(pos, (psi.unsqueeze(-1) + psi.unsqueeze(-2)) /
                         torch.where(pos, ssum, 1.0), torch.zeros_like(ssum))
        ghat = u.mT @ g @ v  # (B, k, k)
        a1, a2 = d1 * ghat, d2 * ghat
        core = (a1 + a1.mT) / 2 + (a2 - a2.mT) / 2  # (B, k, k)
        grad = u @ core @ vh  # (B, m, n)
        # Out-of-span parts (non-square W): (I−UUᵀ)·G·V·diag(ψ/s)·Vᵀ + U·diag(ψ/s)·Uᵀ·G·(I−VVᵀ).
        gv = g @ v  # (B, m, k)
        utg = u.mT @ g  # (B, k, n)
        grad = grad + ((gv - u @ ghat) * ratio.unsqueeze(-2)) @ vh
        grad = grad + u @ (ratio.unsqueeze(-1) * (utg - ghat @ vh))
        # c(s) and γ(s) depend on all singular values: dL/dsᵢ through them, then U·diag·Vᵀ.
        with torch.enable_grad():
            s_live = s.detach().clone().requires_grad_(True)
            f = _psi_live(s_live, gamma, target, nz, top, ~(clamped | limit), limit,
                          torch.diagonal(ghat, dim1=-2, dim2=-1).detach())
            (gs,) = torch.autograd.grad(f, s_live)
        gs = torch.where(nz, gs, torch.zeros_like(gs))
        grad = grad + (u * gs.unsqueeze(-2)) @ vh
        grad = torch.where(ident.unsqueeze(-1).unsqueeze(-1), g, grad)
        return grad, None, None, None


def spectral_reshape(w: Tensor, target_pr: Tensor | float,
                     identity: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Differentiable :func:`apply_target` for a batch ``w`` (B, m, n): ``(w_new, gamma,
    pr, clamped)``. The gradient holds the *target* fixed (γ and c follow W) and uses
    divided differences, finite where singular values repeat (autograd through
    ``torch.linalg.svd`` gives NaN there). ``identity`` rows (and flat ones) pass through
    with an identity gradient; clamped rows hold γ."""
    if w.ndim != 3:
        raise ValueError(f"spectral_reshape needs (B, m, n), got {tuple(w.shape)}")
    a = w.to(torch.float64)
    t = torch.as_tensor(target_pr, dtype=torch.float64, device=w.device).expand(w.shape[0])
    ident = (torch.zeros(w.shape[0], dtype=torch.bool, device=w.device) if identity is None
             else identity.to(device=w.device, dtype=torch.bool))
    rtol = default_rtol(min(w.shape[-2:]), w.dtype)
    out, gamma, pr, clamped = _SpectralReshape.apply(a, t.contiguous(), ident, rtol)
    return out.to(w.dtype), gamma, pr, clamped
