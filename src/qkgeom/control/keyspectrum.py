"""Key-spectrum control during training (experiment E3; docs/definitions.md#key-spectrum-control).

:meth:`KeySpectrumControl.attach` finds the key projection W_K of every layer of a model
(any family :mod:`qkgeom.arch` supports: the project's GPT, Hugging Face GPT-2,
GPT-NeoX/Pythia, Llama-style and BERT-style models) and, after each optimiser step
(``how="post_step"``) or inside every forward pass (``how="parametrize"``), replaces each
controlled unit -- a whole layer's W_K (``scope="layer"``, d_k × d_model) or each head's
slice (``scope="head"``, d_head × d_model) -- by ``c·U·diag(s^γ)·Vᵀ`` with PR(s′²) on a
target (:mod:`qkgeom.control.spectrum`) and ``c`` set by the scale rule.

Targets per unit, with PR0 = the unit's PR_K at step 0, base(t) = the reference run's PR_K
at step t (``reference``) or PR0, and r(t) going linearly from 1 at step 0 to ``dose`` at
``ramp_steps`` (:func:`dose_at`):

* ``none``: nothing at all -- no SVD, no writes, training is bit-identical (with
  ``record`` it measures PR_K after each step, and never writes).
* ``hold``: PR0, in both directions.
* ``shrink``: min(current PR, r(t)·base(t)): a cap that only ever lowers PR.
* ``sham``: min(current PR, base(t)), and the reshape (eigendecomposition round trip and
  rescale) is applied at every step even when the target is the current PR: the arm gets
  the operation every controlled arm gets while intending no change.
* ``expand``: max(current PR, r(t)·base(t)), capped at the largest PR, min(rows, d_model).

Scale rule: ``frobenius`` keeps ‖W_K‖_F of each unit; ``data`` keeps tr(W S Wᵀ), the mean
squared key norm on the layer's inputs, with S a running estimate of E[x xᵀ] of the key
projection's input (:mod:`qkgeom.control.moments`). ``c`` is computed from the reshaped
matrix itself, so the kept quantity holds to round-off.

What is controlled is W_K in nn.Linear layout ``(d_k, d_model)`` (head ``h`` owning rows
``h·hd:(h+1)·hd``), found through the architecture's :class:`~qkgeom.arch.AttentionSite`:
fused q/k/v tensors (GPT-2's ``c_attn``, NeoX's interleaved ``query_key_value``) are
addressed through the site's views and written in place, so W_Q and W_V are never touched.
With grouped-query attention "heads" are the key/value heads. Rotary embeddings act after
W_K and are not part of the controlled matrix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from qkgeom.arch import AttentionSite, adapter_for
from qkgeom.config import KeyControlConfig
from qkgeom.control.moments import InputMoments
from qkgeom.control.spectrum import default_rtol, fit_spectrum, spectral_reshape
from qkgeom.control.trajectory import reference_table
from qkgeom.errors import QKGeomError
from qkgeom.geometry.spectra import participation_ratio, pr_from_covariance, weight_pr

__all__ = [
    "HOWS",
    "MODES",
    "SCALES",
    "SCOPES",
    "KeySpectrumControl",
    "KeySpectrumParametrization",
    "dose_at",
]

MODES = KeyControlConfig.MODES
SCALES = KeyControlConfig.SCALES
SCOPES = KeyControlConfig.SCOPES
HOWS = KeyControlConfig.HOWS
_STATE_VERSION = 2
_RECORD_FIELDS = ("target", "sched", "base", "dose", "pr", "pr_before", "gamma", "clamped",
                  "bound_share")


def dose_at(step: int, dose: float, ramp_steps: int) -> float:
    """r(t): 1 at step 0, linear to ``dose`` at ``ramp_steps``, then ``dose`` (at once for a
    ramp of 0)."""
    frac = 1.0 if ramp_steps <= 0 else min(max(step / ramp_steps, 0.0), 1.0)
    return 1.0 + (dose - 1.0) * frac


def _eigh_dtype(device: torch.device, r: int) -> torch.dtype:
    """The precision of the batched eigendecomposition of (U, r, r) Gram matrices.

    float64 for r <= 32 (cheap everywhere; CUDA's batched Jacobi solver covers it) and
    float32 above: on CPU float32 halves the cost (4 × 128², 1 thread: 2.6 vs 5.3 ms), on
    CUDA it avoids float64 LAPACK-style solvers, which are slow for batches of large
    matrices. Enough for the invariants: the reshape is a smooth matrix function whose
    per-step change is small, the reshaped units' PR is re-measured in float64 (on target
    within 1e-3) and the scale factor is computed from the reshaped matrix in float64.
    """
    return torch.float64 if r <= 32 else torch.float32


def _gram(a: Tensor, wide: bool) -> Tensor:
    """A·Aᵀ (wide units) or Aᵀ·A (tall): (U, r, r) with r = min(m, d)."""
    return a @ a.mT if wide else a.mT @ a


def _quad_trace(a: Tensor, s: Tensor | None) -> Tensor:
    """tr(A S Aᵀ) per unit (``S`` None: ‖A‖_F²); a (U, m, d), s (U, d, d), float64."""
    return (a * a if s is None else (a @ s) * a).sum(dim=(-2, -1))


class KeySpectrumParametrization(nn.Module):
    """``forward(W)`` = W with its key (per layer or per head) reshaped to PR = ``target``.

    The ``torch.nn.utils.parametrize`` idiom: the stored parameter is the unconstrained
    ``original``; the model sees the reshaped weight, and gradients flow through the
    reshape (:func:`~qkgeom.control.spectrum.spectral_reshape`) and the scale factor.
    ``target``, ``identity`` (units passed through, e.g. a shrink cap above the current
    PR) and ``moment`` (S of the data scale rule, or None for frobenius) are non-persistent
    buffers that :class:`KeySpectrumControl` updates after each step. For fused q/k/v
    weights only the key slice changes.
    """

    def __init__(self, site: AttentionSite, scope: str, target: Tensor) -> None:
        super().__init__()
        self.site, self.scope = site, scope
        n_units = site.n_kv_head if scope == "head" else 1
        self.register_buffer("target", torch.as_tensor(target, dtype=torch.float64)
                             .reshape(n_units).clone(), persistent=False)
        self.register_buffer("identity", torch.zeros(n_units, dtype=torch.bool),
                             persistent=False)
        self.register_buffer("moment", None, persistent=False)
        self.last_gamma: Tensor | None = None
        self.last_clamped: Tensor | None = None

    def forward(self, w: Tensor) -> Tensor:
        heads = self.site.k_heads(w)  # (H_kv, hd, d)
        k = heads if self.scope == "head" else heads.reshape(1, -1, self.site.d_model)  # (U, m, d)
        k_new, gamma, _, clamped = spectral_reshape(k, self.target, self.identity)
        if self.moment is not None:  # data scale: tr(K S Kᵀ) kept, differentiably
            k64, new64 = k.to(torch.float64), k_new.to(torch.float64)
            s = self.moment.expand(k.shape[0], -1, -1)
            c = torch.sqrt(_quad_trace(k64, s) / _quad_trace(new64, s).clamp_min(1e-300))
            k_new = k_new * c.to(k_new.dtype)[:, None, None]
        self.last_gamma, self.last_clamped = gamma.detach(), clamped.detach()
        if self.site.k_module is not self.site.q_module:  # W_K alone in its weight
            return k_new.reshape(w.shape)
        out = w.clone()  # fused q/k/v: only the key slice changes
        self.site.k_heads(out).copy_(k_new.reshape(heads.shape))
        return out

    def right_inverse(self, w: Tensor) -> Tensor:
        """Assigning a weight stores it as the unconstrained original (the model then sees
        its projection); a weight already on target is a fixed point."""
        return w


class KeySpectrumControl:
    """Holds / shrinks / shams / expands the key spectrum of a model's layers (or heads).

    Build it with :meth:`attach`. Call :meth:`step` after every optimiser step (with
    ``scale="data"`` the hook collects the key inputs during your training forward passes,
    so S starts from the first one); read :meth:`last` (flat dict of the records) for
    logging and :meth:`reset_window` after each read. ``state_dict`` keeps PR0, the step
    counter, the bound counters and S, so a resumed run continues bit for bit.
    """

    def __init__(self, model: nn.Module, arch: str, sites: list[AttentionSite], *, mode: str,
                 scope: str, scale: str, dose: float, ramp_steps: int, how: str,
                 record: bool) -> None:
        self.model, self.arch, self.sites = model, arch, sites
        self.mode, self.scope, self.scale, self.how = mode, scope, scale, how
        self.dose, self.ramp_steps, self.record = float(dose), int(ramp_steps), record
        self.names: list[str] = []
        self._slices: list[slice] = []  # units of each site
        for site in sites:
            start = len(self.names)
            if scope == "head":
                self.names += [f"l{site.layer}h{h}" for h in range(site.n_kv_head)]
            else:
                self.names.append(f"l{site.layer}")
            self._slices.append(slice(start, len(self.names)))
        self._site_of = torch.tensor([j for j, sl in enumerate(self._slices)
                                      for _ in range(sl.start, sl.stop)], dtype=torch.long)
        max_pr: list[float] = []  # largest PR each matrix can have: min(d_out, d_model)
        for site, sl in zip(sites, self._slices, strict=True):
            rows = site.head_dim if scope == "head" else site.n_kv_head * site.head_dim
            max_pr += [float(min(rows, site.d_model))] * (sl.stop - sl.start)
        n = len(self.names)
        self._max_pr = torch.tensor(max_pr, dtype=torch.float64)
        self.pr0 = torch.full((n,), math.nan, dtype=torch.float64)
        self.reference: Tensor | None = None  # (last step + 1, units): base(t) per unit
        self.step_count = 0
        self.reshapes = 0  # units rewritten so far (sham: every unit at every step)
        self._bound = torch.zeros(n, dtype=torch.float64)  # steps the cap bound, this window
        self._window = 0  # steps since the last reset_window()
        self._last: dict[str, Tensor] = {}
        self._params: list[KeySpectrumParametrization] = []
        self.moments: InputMoments | None = None
        self.trajectory: tuple[list[int], list[Tensor]] = ([], [])  # record: steps, PRs

    # ----------------------------------------------------------------- construction

    @classmethod
    def attach(cls, model: nn.Module, mode: str = "hold", *, scope: str = "layer",
               scale: str = "data", dose: float | None = None, ramp_steps: int = 0,
               reference: str | Path | None = None, how: str = "post_step",
               layers: Iterable[int] | None = None, record: bool = False,
               record_initial: bool = True) -> KeySpectrumControl:
        """Validate, find the key weights, record PR0 and (for ``parametrize``) register.

        Args:
            model: the project's GPT or a supported HF model (see module docstring).
            mode: one of :data:`MODES`; ``"none"`` touches nothing (without ``record`` not
                even the lookup).
            scope: ``"layer"`` (whole W_K) or ``"head"`` (each head's slice).
            scale: ``"data"`` (keep the mean squared key norm on the layer's inputs; S is
                collected by a hook from training forwards) or ``"frobenius"`` (keep ‖W_K‖_F).
            dose: r, the final cap as a multiple of base(t): shrink (0, 1] (default 0.5),
                expand >= 1 (default 2), sham 1; hold takes none.
            ramp_steps: steps over which r(t) goes from 1 to ``dose`` (0: at once).
            reference: a run folder with a ``key_pr.parquet`` (trained with
                ``key_control.record``): base(t) is its PR_K at step t; None: PR0.
            how: ``"post_step"`` (project after each :meth:`step`) or ``"parametrize"``.
            layers: layer indices to control (default all).
            record: keep every step's PR_K in :attr:`trajectory`.
            record_initial: take PR0 from the weights now (a fresh run at step 0). Pass
                False when the state comes from :meth:`load_state_dict` (resume).
        Raises:
            QKGeomError: bad arguments or an unsupported architecture.
        """
        settings = KeyControlConfig(mode=mode, scale=scale, dose=0.0 if dose is None else dose,
                                    reference=str(reference or ""), scope=scope, how=how,
                                    record=bool(record))
        settings.validate(prefix="key control ")
        if int(ramp_steps) < 0:
            raise QKGeomError(f"key control ramp_steps must be >= 0, got {ramp_steps}")
        kw = dict(mode=mode, scope=scope, scale=scale, dose=settings.dose,
                  ramp_steps=int(ramp_steps), how=how, record=bool(record))
        if not settings.active:
            return cls(model, "", [], **kw)
        adapter = adapter_for(model)
        arch, sites = adapter.arch, adapter.sites
        if layers is not None:
            wanted = sorted({int(i) for i in layers})
            bad = [i for i in wanted if not 0 <= i < len(sites)]
            if bad or not wanted:
                raise QKGeomError(f"layers {bad or '[]'} out of range: the model has "
                                  f"{len(sites)} layers (0..{len(sites) - 1})")
            sites = [sites[i] for i in wanted]
        for site in sites:
            if parametrize.is_parametrized(site.k_module, "weight"):
                raise QKGeomError(f"layer {site.layer}: its key weight is already "
                                  "parametrised (is a key control attached twice?)")
        ctl = cls(model, arch, sites, **kw)
        if reference:
            ctl.reference = reference_table(reference, ctl.names)
        pr_now = ctl.current_pr()
        if record_initial:
            ctl.pr0 = pr_now.clone()
            ctl._last = ctl._initial_record()
            if record:
                ctl.trajectory = ([0], [pr_now.clone()])
        if mode != "none" and scale == "data":
            ctl.moments = InputMoments(sites)
        if mode != "none" and how == "parametrize":
            for site, sl in zip(sites, ctl._slices, strict=True):
                p = KeySpectrumParametrization(site, scope, pr_now[sl])
                p.identity.fill_(True)  # the identity until the first step sets targets
                p.to(site.key_stored().device)
                parametrize.register_parametrization(site.k_module, "weight", p)
                ctl._params.append(p)
        return ctl

    def remove(self) -> None:
        """Undo the attachment: the input hooks, and a ``parametrize`` registration (keeping
        the current, reshaped weights)."""
        if self.moments is not None:
            self.moments.remove()
        for site in self.sites:
            if parametrize.is_parametrized(site.k_module, "weight"):
                parametrize.remove_parametrizations(site.k_module, "weight",
                                                    leave_parametrized=True)
        self._params = []

    # ----------------------------------------------------------------- reading

    def _units(self, site: AttentionSite, w: Tensor) -> Tensor:
        heads = site.k_heads(w.detach())  # (H_kv, hd, d)
        mats = heads if self.scope == "head" else heads.reshape(1, -1, site.d_model)
        return mats.to(torch.float64)  # (U, m, d)

    def current_pr(self) -> Tensor:
        """PR_K of every controlled matrix as the model sees it now (float64, (N,))."""
        if not self.sites:
            return torch.zeros(0, dtype=torch.float64)
        with torch.no_grad():
            prs = [weight_pr(self._units(site, site.key_effective())).cpu()
                   for site in self.sites]
        return torch.cat(prs)

    def base_at(self, step: int) -> Tensor:
        """base(t) of every unit: the reference run's PR_K at ``step``, or PR0."""
        if self.reference is None:
            return self.pr0
        if not 0 <= step < self.reference.shape[0]:
            raise QKGeomError(f"the reference run's key PR trajectory ends at step "
                              f"{self.reference.shape[0] - 1}; this run is at step {step}")
        return self.reference[step]

    def hold_level(self) -> Tensor:
        """The PR ``hold`` keeps each unit at: PR0. A subclass may move it (the monitor's
        closed loop steers it toward a target attention entropy)."""
        return self.pr0

    def _targets(self, idx: Tensor, pr_before: Tensor) -> dict[str, Tensor]:
        """target, sched (the cap before the current-PR bound), base, bound (the cap
        decided the target) for the units ``idx`` at the current step."""
        t = self.step_count
        base = self.hold_level()[idx] if self.mode == "hold" else self.base_at(t)[idx]
        r = 1.0 if self.mode == "hold" else dose_at(t, self.dose, self.ramp_steps)
        sched = r * base
        if self.mode == "hold":
            return {"target": sched, "sched": sched, "base": base,
                    "bound": torch.ones_like(sched, dtype=torch.bool), "dose": r}
        if self.mode == "expand":
            cap = torch.minimum(sched, self._max_pr[idx])
            bound = cap > pr_before
        else:  # shrink, sham
            cap, bound = sched, sched < pr_before
        return {"target": torch.where(bound, cap, pr_before), "sched": sched, "base": base,
                "bound": bound, "dose": r}

    # ----------------------------------------------------------------- stepping

    def step(self, step: int | None = None) -> dict[str, float]:
        """Apply the control after an optimiser step; returns :meth:`last`.

        ``step`` is the number of optimiser updates done (default: one more than last
        time); it sets where on the ramp and the reference trajectory the targets are.
        """
        if not self.sites:
            return {}
        self.step_count = self.step_count + 1 if step is None else int(step)
        if bool(torch.isnan(self.pr0).any()):
            raise QKGeomError("key control has no step-0 PRs: attach with record_initial=True "
                              "or load_state_dict() from a checkpoint before stepping")
        if self.moments is not None:
            self.moments.fold()
        if self.mode == "none":
            pr = self.current_pr()
            self._last = {"pr": pr, "pr_before": pr}
        elif self.how == "parametrize":
            self._last = self._set_param_targets()
        else:
            self._last = self._project()
        self._window += 1
        if self.record:
            self.trajectory[0].append(self.step_count)
            self.trajectory[1].append(self._last["pr"].clone())
        return self.last()

    def _groups(self) -> list[list[int]]:
        """Site indices grouped by unit shape, dtype and device: one batched eigh each."""
        groups: dict[tuple, list[int]] = {}
        for j, site in enumerate(self.sites):
            w = site.key_stored()
            rows = site.head_dim if self.scope == "head" else site.n_kv_head * site.head_dim
            groups.setdefault((rows, site.d_model, w.dtype, w.device), []).append(j)
        return list(groups.values())

    def _moment_units(self, idx: Tensor) -> Tensor | None:
        """S for each unit of ``idx`` (its layer's), (U, d, d); None for frobenius."""
        if self.moments is None:
            return None
        sites = self._site_of[idx].tolist()
        return torch.stack([self.moments.matrix(j) for j in sites])

    @torch.no_grad()
    def _project(self) -> dict[str, Tensor]:
        """post_step: per group of equally shaped units, the Gram matrices (in the
        eigendecomposition's precision, :func:`_eigh_dtype`), their PR (tr² / ‖·‖², no
        eigendecomposition), the targets, then -- only for the units that
        need it (every unit for hold and sham, those whose cap binds for shrink and expand)
        -- one batched eigendecomposition (:func:`_eigh_dtype`), the fit of γ on the CPU,
        ``W″ = U·diag(s^γ/s)·Uᵀ·W`` (= U·diag(s^γ)·Vᵀ), the scale factor c from W and W″,
        in-place writes, and the achieved PR re-measured on the stored weights.

        Singular values are floored at 2·rtol·s_max before the fit, so none is treated as
        zero: the Gram route resolves them only down to about √eps·s_max, and a value that
        is small but real must be rescaled, not deleted (a sham step must be a round trip).
        """
        n = len(self.names)
        rec = {f: torch.zeros(n, dtype=torch.float64) for f in _RECORD_FIELDS}
        for group in self._groups():
            sites = [self.sites[j] for j in group]
            idx = torch.cat([torch.arange(self._slices[j].start, self._slices[j].stop)
                             for j in group])  # unit indices, in stacking order
            a_stored = torch.cat([self._raw_units(site) for site in sites])  # (U, m, d)
            a = a_stored.to(torch.float64)
            wide = a.shape[-2] <= a.shape[-1]
            dtype = _eigh_dtype(a.device, min(a.shape[-2:]))
            gram = _gram(a.to(dtype), wide)  # (U, r, r), r = min(m, d)
            pr_before = pr_from_covariance(gram).cpu()  # (U,)
            tg = self._targets(idx, pr_before)
            need = tg["bound"] | (self.mode == "sham")
            target, gamma = tg["target"].clone(), torch.ones_like(pr_before)
            clamped, pr_after = torch.zeros_like(pr_before), pr_before.clone()
            changed = torch.zeros_like(need)
            if bool(need.any()):
                sub = torch.nonzero(need).flatten()
                fit, act, new = self._reshape(a[sub.to(a.device)], gram[sub.to(a.device)],
                                              target[sub], ~tg["bound"][sub], idx[sub], wide,
                                              a_stored.dtype)
                target[sub] = torch.where(fit.flat, pr_before[sub], fit.target)
                gamma[sub] = fit.gamma
                clamped[sub] = fit.clamped.to(torch.float64)
                changed[sub] = act
                if bool(act.any()):
                    stored = new[act.to(new.device)].to(a_stored.dtype)  # what will be stored
                    self._write(group, sub[act].tolist(), stored, idx)
                    pr_after[sub[act]] = pr_from_covariance(_gram(stored.to(dtype), wide)).cpu()
                    self.reshapes += int(act.sum())
            hit = changed if self.mode == "hold" else tg["bound"]
            self._bound[idx] += hit.to(torch.float64)
            rec["target"][idx] = target
            rec["sched"][idx] = tg["sched"]
            rec["base"][idx] = tg["base"]
            rec["dose"][idx] = tg["dose"]
            rec["pr_before"][idx] = pr_before
            rec["gamma"][idx] = gamma
            rec["clamped"][idx] = clamped
            rec["pr"][idx] = pr_after
        return rec

    def _reshape(self, a: Tensor, gram: Tensor, target: Tensor, keep: Tensor, idx: Tensor,
                 wide: bool, stored: torch.dtype) -> tuple[Any, Tensor, Tensor]:
        """(fit, act, W′) for units ``a`` (U, m, d) float64 with Gram matrices ``gram``:
        ``act`` marks the units to rewrite (γ ≠ 1, or any sham unit; never a flat one).
        ``keep`` marks units whose target is their current PR (a sham cap that does not
        bind): they get γ = 1 exactly, whatever the PR of the computed eigenvalues."""
        r = gram.shape[-1]
        norm = torch.diagonal(gram, dim1=-2, dim2=-1).amax(-1).clamp_min(1e-30)  # (U,)
        lam, vec = torch.linalg.eigh(gram / norm[:, None, None])  # ascending, gram's dtype
        lam = (lam.flip(-1).to(torch.float64) * norm[:, None]).cpu()  # (U, r) descending
        vec = vec.flip(-1)
        rtol = default_rtol(r, stored)
        floor = (2 * rtol) ** 2 * lam[:, :1].clamp_min(0)
        s = torch.maximum(lam, floor).sqrt()  # (U, r) singular values, none below the floor
        target = torch.where(keep, participation_ratio(s * s), target)
        fit = fit_spectrum(s, target, rtol=rtol)
        act = ~fit.flat & ((fit.gamma != 1) | (self.mode == "sham"))
        ratio = torch.where(s > 0, fit.s / torch.where(s > 0, s, torch.ones_like(s)),
                            torch.zeros_like(s))
        ratio = torch.where(act[:, None], ratio, torch.ones_like(ratio))
        mix = (vec * ratio.to(vec)[:, None, :]) @ vec.mT  # U·diag(s′/s)·Uᵀ, (U, r, r)
        a_c = a.to(mix.dtype)
        new = (mix @ a_c if wide else a_c @ mix).to(torch.float64)  # the unscaled reshape W″
        s_units = self._moment_units(idx)
        if s_units is not None:
            s_units = s_units.to(a.device)
        c = torch.sqrt(_quad_trace(a, s_units) / _quad_trace(new, s_units).clamp_min(1e-300))
        return fit, act, new * c[:, None, None]

    def _write(self, group: list[int], units: list[int], new: Tensor, idx: Tensor) -> None:
        """Copy reshaped units (positions ``units`` in the group's stacking) into W_K."""
        pos = {int(idx[u]): k for k, u in enumerate(units)}
        for j in group:
            site, sl = self.sites[j], self._slices[j]
            view = site.k_heads(site.key_stored())  # (H_kv, hd, d) view, in place
            for g in range(sl.start, sl.stop):
                if g in pos:
                    k = pos[g]
                    if self.scope == "head":
                        view[g - sl.start].copy_(new[k])
                    else:
                        view.copy_(new[k].view(view.shape))

    def _raw_units(self, site: AttentionSite) -> Tensor:
        """The stored W_K of a site as units, (U, m, d) in the stored dtype (a copy)."""
        heads = site.k_heads(site.key_stored().detach())  # (H_kv, hd, d)
        return (heads if self.scope == "head" else heads.reshape(1, -1, site.d_model)).clone()

    def _set_param_targets(self) -> dict[str, Tensor]:
        """parametrize: set each parametrisation's targets for the coming forward passes."""
        n = len(self.names)
        rec = {f: torch.zeros(n, dtype=torch.float64) for f in _RECORD_FIELDS}
        with torch.no_grad():
            for j, (site, sl, p) in enumerate(zip(self.sites, self._slices, self._params,
                                                  strict=True)):
                idx = torch.arange(sl.start, sl.stop)
                pr_before = weight_pr(self._units(site, site.key_stored())).cpu()  # unconstrained
                tg = self._targets(idx, pr_before)
                identity = ~tg["bound"] & torch.as_tensor(self.mode != "sham")
                p.target.copy_(tg["target"])
                p.identity.copy_(identity)
                if self.moments is not None:
                    p.moment = self.moments.matrix(j).to(site.key_stored().device)
                effective = site.key_effective()  # runs the parametrisation, new targets
                gamma, clamped = p.last_gamma.cpu(), p.last_clamped.cpu()
                hit = (gamma != 1) if self.mode == "hold" else tg["bound"]
                self._bound[idx] += hit.to(torch.float64)
                self.reshapes += int((~identity).sum())
                rec["target"][idx] = tg["target"]
                rec["sched"][idx] = tg["sched"]
                rec["base"][idx] = tg["base"]
                rec["dose"][idx] = tg["dose"]
                rec["pr_before"][idx] = pr_before
                rec["gamma"][idx] = torch.where(identity, torch.ones_like(gamma), gamma)
                rec["clamped"][idx] = (clamped & ~identity).to(torch.float64)
                rec["pr"][idx] = weight_pr(self._units(site, effective)).cpu()
        return rec

    # ----------------------------------------------------------------- records

    def _initial_record(self) -> dict[str, Tensor]:
        n = len(self.names)
        if self.mode == "none":
            return {"pr": self.pr0.clone(), "pr_before": self.pr0.clone()}
        tg = self._targets(torch.arange(n), self.pr0)
        return {"target": self.pr0.clone(), "sched": tg["sched"], "base": tg["base"].clone(),
                "dose": torch.full((n,), float(tg["dose"]), dtype=torch.float64),
                "pr": self.pr0.clone(), "pr_before": self.pr0.clone(),
                "gamma": torch.ones(n, dtype=torch.float64),
                "clamped": torch.zeros(n, dtype=torch.float64)}

    def last(self) -> dict[str, float]:
        """The last step's records as a flat dict ``ctl_<field>_<unit>`` (unit ``l3`` or
        ``l3h1``; none for mode ``none``): target (PR aimed at), sched (the cap r(t)·base(t)
        before the current-PR bound; PR0 for hold), base (base(t)), dose (r(t)), pr
        (achieved, measured on the weights), pr_before, gamma, clamped (0/1) and
        bound_share (share of the steps since :meth:`reset_window` where the cap bound;
        hold: where the reshape changed the spectrum; NaN before any step). Before any
        step: the step-0 values (target = pr = PR0, gamma 1)."""
        if self.mode == "none":
            return {}
        rec = dict(self._last)
        rec["bound_share"] = (self._bound / self._window if self._window
                              else torch.full_like(self._bound, math.nan))
        out: dict[str, float] = {}
        for f in _RECORD_FIELDS:
            if f in rec:  # one conversion per field, not one per unit
                out.update(zip((f"ctl_{f}_{name}" for name in self.names),
                               map(float, rec[f].tolist()), strict=True))
        return out

    def reset_window(self) -> None:
        """Start a new window for ``bound_share`` (call after reading :meth:`last`)."""
        self._bound.zero_()
        self._window = 0

    def targets(self) -> dict[str, float]:
        """``{"ctl_target_<unit>": PR aimed at in the last step}``."""
        return {k: v for k, v in self.last().items() if k.startswith("ctl_target_")}

    # ----------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "mode": self.mode, "scope": self.scope,
                "scale": self.scale, "arch": self.arch, "names": list(self.names),
                "pr0": [float(v) for v in self.pr0], "step": int(self.step_count),
                "last": {f: [float(x) for x in v] for f, v in self._last.items()},
                "bound": [float(v) for v in self._bound], "window": int(self._window),
                "reshapes": int(self.reshapes),
                "moments": self.moments.state_dict() if self.moments is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore PR0, the step counter, the window counters, S and the last records.

        The per-step record (:attr:`trajectory`) is not part of the state: the callback
        keeps it in the run's key_pr.parquet and restores it from there."""
        if not state:
            raise QKGeomError("empty key-control state: the checkpoint was written without "
                              "key control")
        if state.get("version") != _STATE_VERSION:
            raise QKGeomError(f"saved key-control state version {state.get('version')!r}; "
                              f"this qkgeom reads {_STATE_VERSION}: train the run again")
        for key in ("mode", "scope", "scale", "names"):
            if state.get(key) != getattr(self, key):
                raise QKGeomError(f"saved key-control {key} {state.get(key)!r} does not match "
                                  f"this run's {getattr(self, key)!r}")
        pr0 = torch.tensor(state["pr0"], dtype=torch.float64)
        if self.names and not bool(torch.isfinite(pr0).all()):
            raise QKGeomError("saved key-control state has no valid step-0 PRs")
        self.pr0 = pr0
        self.step_count = int(state["step"])
        self._bound = torch.tensor(state["bound"], dtype=torch.float64)
        self._window = int(state["window"])
        self.reshapes = int(state["reshapes"])
        if self.moments is not None:
            self.moments.load_state_dict(state["moments"] or [])
        if self.how == "parametrize" and self._params:
            bound, window, reshapes = self._bound.clone(), self._window, self.reshapes
            self._set_param_targets()  # targets of the saved step, for the coming forwards
            self._bound, self._window, self.reshapes = bound, window, reshapes
        # keep the saved records: they describe the step the checkpoint was taken at
        self._last = {f: torch.tensor(v, dtype=torch.float64)
                      for f, v in state.get("last", {}).items()}
