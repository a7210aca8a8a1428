"""Key-spectrum control during training (experiment E3).

After each optimiser step (``post_step``) or inside every forward pass (``parametrize``),
each controlled unit -- a layer's W_K or one head's slice, found through the model's
:class:`~qkgeom.arch.AttentionSite`, so a fused q/k/v weight changes in its key slice only --
is reshaped so that the spectrum at its level (``token``: W Σ_ε Wᵀ on the layer's inputs;
``weight``: W itself) has the mode's target PR, then rescaled by the scale rule. Levels,
modes, targets, scale rules and records: docs/definitions.md#key-spectrum-control.
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
from qkgeom.control.trajectory import FIELDS, reference_table
from qkgeom.errors import QKGeomError
from qkgeom.geometry.spectra import participation_ratio, pr_from_covariance, weight_pr

__all__ = ["HOWS", "LEVELS", "MODES", "SCALES", "SCOPES", "KeySpectrumControl",
           "KeySpectrumParametrization", "dose_at"]

MODES = KeyControlConfig.MODES
LEVELS = KeyControlConfig.LEVELS
SCALES = KeyControlConfig.SCALES
SCOPES = KeyControlConfig.SCOPES
HOWS = KeyControlConfig.HOWS
_STATE_VERSION = 4
_READS = (3, 4)  # 3 lacks the keys of the last step: one step without ``pr_oos`` after it
_RECORD_FIELDS = ("target", "sched", "base", "dose", "pr", "pr_raw", "pr_oos", "pr_before",
                  "gamma", "clamped", "bound_share", "spread", "spread_target")


def dose_at(step: int, dose: float, ramp_steps: int) -> float:
    """r(t): 1 at step 0, linear to ``dose`` at ``ramp_steps``, then ``dose`` (at once for a
    ramp of 0)."""
    frac = 1.0 if ramp_steps <= 0 else min(max(step / ramp_steps, 0.0), 1.0)
    return 1.0 + (dose - 1.0) * frac


def _quad_trace(a: Tensor, s: Tensor | None) -> Tensor:
    """tr(A S Aᵀ) per unit (``S`` None: ‖A‖_F²); a (U, m, d), s (U, d, d), float64."""
    return (a * a if s is None else (a @ s) * a).sum(dim=(-2, -1))


def _keep_scale(spread: Tensor, a: Tensor, new: Tensor, s: Tensor | None) -> Tensor:
    """(U,) factors c giving the reshaped units ``new`` the key spread ``spread`` where it
    is finite, else that of the units ``a`` before the reshape (both (U, m, d) float64)."""
    kept = torch.where(torch.isfinite(spread), spread, _quad_trace(a, s))
    return torch.sqrt(kept / _quad_trace(new, s).clamp_min(1e-300))


def _level_gram(a: Tensor, s_eps: Tensor | None) -> tuple[Tensor, bool]:
    """(C, left): the matrix whose eigenvalues are the controlled spectrum of units ``a``
    (U, m, d) float64, and whether the reshape acts from the left (C is m × m).

    Token level (``s_eps`` given): C = A Σ_ε Aᵀ. Weight level: A Aᵀ for a wide unit,
    Aᵀ A for a tall one (the smaller Gram matrix)."""
    if s_eps is not None:
        c = a @ s_eps @ a.mT
        return (c + c.mT) / 2, True
    wide = a.shape[-2] <= a.shape[-1]
    return (a @ a.mT if wide else a.mT @ a), wide


def _token_grams(a: Tensor, s_raw: Tensor, ridge: Tensor) -> tuple[Tensor, Tensor]:
    """(A Σ_ε Aᵀ, A Σ Aᵀ) of units ``a`` (U, m, d) float64 with Σ_ε = Σ + ridge·I (``ridge``
    (U,) or a scalar): three matrix products for the PR on both and the spread (the trace
    of the second)."""
    raw, _ = _level_gram(a, s_raw)
    return raw + torch.as_tensor(ridge).reshape(-1, 1, 1) * (a @ a.mT), raw


def _units_of(site: AttentionSite, scope: str, w: Tensor) -> Tensor:
    """``w`` (laid out like the site's key weight) as the controlled units (U, m, d): each
    key head (``scope`` head) or the whole W_K."""
    heads = site.k_heads(w)  # (H_kv, hd, d)
    return heads if scope == "head" else heads.reshape(1, -1, site.d_model)


def _sqrt_pair(s_eps: Tensor) -> tuple[Tensor, Tensor]:
    """(Σ_ε^½, Σ_ε^−½) of a symmetric positive definite (d, d) matrix, float64."""
    lam, vec = torch.linalg.eigh(s_eps)
    root = lam.clamp_min(torch.finfo(lam.dtype).tiny).sqrt()
    return (vec * root) @ vec.mT, (vec / root) @ vec.mT


class KeySpectrumParametrization(nn.Module):
    """``forward(W)``: W with its key units reshaped to PR = ``target`` (the token level
    reshapes W Σ_ε^½ and maps back by Σ_ε^−½), differentiably. Its buffers -- ``target``,
    ``identity`` (units passed through), ``moment`` (Σ of the data rule), ``root``/``iroot``
    (Σ_ε^±½) and ``spread`` (to match; NaN: keep) -- are set by :class:`KeySpectrumControl`
    after each step; until then every unit passes through."""

    def __init__(self, site: AttentionSite, scope: str, level: str, scale: str) -> None:
        super().__init__()
        self.site, self.scope, self.level, self.scale = site, scope, level, scale
        n_units = site.n_kv_head if scope == "head" else 1
        self.register_buffer("target", torch.ones(n_units, dtype=torch.float64),
                             persistent=False)
        self.register_buffer("identity", torch.ones(n_units, dtype=torch.bool),
                             persistent=False)
        self.register_buffer("spread", torch.full((n_units,), math.nan, dtype=torch.float64),
                             persistent=False)
        for name in ("moment", "root", "iroot"):
            self.register_buffer(name, None, persistent=False)
        self.last_gamma: Tensor | None = None
        self.last_clamped: Tensor | None = None

    def forward(self, w: Tensor) -> Tensor:
        k = _units_of(self.site, self.scope, w)  # (U, m, d)
        if self.level == "token" and self.root is not None:
            root = self.root.to(k.dtype)
            m_new, gamma, _, clamped = spectral_reshape(k @ root, self.target, self.identity)
            k_new = torch.where(self.identity[:, None, None], k, m_new @ self.iroot.to(k.dtype))
        else:
            k_new, gamma, _, clamped = spectral_reshape(k, self.target, self.identity)
        data = self.scale == "data" and self.moment is not None
        if data or (self.scale == "frobenius" and self.level == "token"):  # it kept ‖W Σ^½‖
            s = self.moment.expand(k.shape[0], -1, -1) if data else None
            c = _keep_scale(self.spread, k.to(torch.float64), k_new.to(torch.float64), s)
            k_new = k_new * c.to(k_new.dtype)[:, None, None]
        self.last_gamma, self.last_clamped = gamma.detach(), clamped.detach()
        if self.site.k_module is not self.site.q_module:  # W_K alone in its weight
            return k_new.reshape(w.shape)
        out = w.clone()  # fused q/k/v: only the key slice changes
        key = self.site.k_heads(out)  # (H_kv, hd, d) view
        key.copy_(k_new.reshape(key.shape))
        return out

    def right_inverse(self, w: Tensor) -> Tensor:
        """An assigned weight is stored as the unconstrained original."""
        return w


def _controlled_sites(sites: list[Any], layers: Iterable[int] | None) -> list[Any]:
    """The attention sites of ``layers`` (all when None), none already parametrised; a
    one-line error for a layer out of range or a control attached twice."""
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
    return sites


class KeySpectrumControl:
    """Holds / shrinks / shams / expands the key spectrum of a model's layers (or heads).

    Build it with :meth:`attach`; call :meth:`step` after every optimiser step (Σ comes
    from your training forward passes), read :meth:`last` and then :meth:`reset_window`.
    ``state_dict`` keeps what a resumed run needs to continue bit for bit.
    """

    def __init__(self, model: nn.Module, arch: str, sites: list[AttentionSite], *, mode: str,
                 level: str, scope: str, scale: str, dose: float, ramp_steps: int, how: str,
                 record: bool) -> None:
        self.model, self.arch, self.sites = model, arch, sites
        self.mode, self.level, self.scope, self.scale, self.how = mode, level, scope, scale, how
        self.dose, self.ramp_steps, self.record = float(dose), int(ramp_steps), record
        self.names: list[str] = []
        self._slices: list[slice] = []  # units of each site
        max_pr: list[float] = []  # the largest PR each unit can have: min(rows, d_model)
        for site in sites:
            units = ([f"l{site.layer}h{h}" for h in range(site.n_kv_head)] if scope == "head"
                     else [f"l{site.layer}"])
            self._slices.append(slice(len(self.names), len(self.names) + len(units)))
            self.names += units
            max_pr += [float(min(self._rows(site), site.d_model))] * len(units)
        n = len(self.names)
        self._max_pr = torch.tensor(max_pr, dtype=torch.float64)
        self.pr0 = torch.full((n,), math.nan, dtype=torch.float64)
        self._w0: list[Tensor] | None = None  # step-0 units until PR0 (token level) is known
        self.reference: dict[str, Tensor] | None = None  # field -> (last step + 1, units)
        self.step_count = 0
        self.reshapes = 0  # units rewritten so far (sham: every unit at every step)
        self._bound = torch.zeros(n, dtype=torch.float64)  # steps the cap bound, this window
        self._window = 0  # steps since the last reset_window()
        self._last: dict[str, Tensor] = {}
        self._params: list[KeySpectrumParametrization] = []
        self.moments: InputMoments | None = None
        self._prev: list[Tensor] | None = None  # per site: the keys the next forward uses
        self.trajectory: tuple[list[int], dict[str, list[Tensor]]] = (
            [], {f: [] for f in FIELDS})  # record: steps and per-step fields

    @classmethod
    def attach(cls, model: nn.Module, mode: str = "hold", *, level: str = "token",
               scope: str = "layer", scale: str = "data", dose: float | None = None,
               ramp_steps: int = 0, reference: str | Path | None = None,
               how: str = "post_step", layers: Iterable[int] | None = None,
               record: bool = False, record_initial: bool = True) -> KeySpectrumControl:
        """The control of ``model`` (the project's GPT or an HF model :mod:`qkgeom.arch`
        supports) on ``layers`` (default all), its step-0 weights noted and, for
        ``parametrize``, registered. The settings are :class:`KeyControlConfig`'s and are
        validated as one (``dose`` None: the mode's default); ``reference`` is a run folder
        recorded with ``key_control.record``; ``record`` keeps every step's PR_K and key
        spread in :attr:`trajectory`; ``record_initial=False`` when the state will come
        from :meth:`load_state_dict`. Mode ``none`` without ``record`` looks nothing up.
        """
        settings = KeyControlConfig(mode=mode, level=level, scale=scale, dose=dose,
                                    reference=str(reference or ""), scope=scope, how=how,
                                    record=bool(record))  # validated as it is built
        if int(ramp_steps) < 0:
            raise QKGeomError(f"key control ramp_steps must be >= 0, got {ramp_steps}")
        kw = dict(mode=mode, level=level, scope=scope, scale=scale,
                  dose=1.0 if settings.dose is None else settings.dose,  # hold: unused
                  ramp_steps=int(ramp_steps), how=how, record=bool(record))
        if not settings.active:
            return cls(model, "", [], **kw)
        adapter = adapter_for(model)
        sites = _controlled_sites(adapter.sites, layers)
        ctl = cls(model, adapter.arch, sites, **kw)
        if reference:
            ctl.reference = reference_table(reference, ctl.names)
        if ctl.needs_moments:
            ctl.moments = InputMoments(sites)
        if record_initial:
            ctl._w0 = ctl._stored_units()
            ctl._prev = ctl._w0
            if level == "weight":
                ctl.pr0 = torch.cat([weight_pr(u).cpu() for u in ctl._w0])
            ctl._last = ctl._initial_record()
        if mode != "none" and how == "parametrize":
            ctl._register_parametrizations()
        return ctl

    def _register_parametrizations(self) -> None:
        """W_K becomes a function of the stored weight, the identity until the first step."""
        for site in self.sites:
            p = KeySpectrumParametrization(site, self.scope, self.level, self.scale)
            p.to(site.key_stored().device)
            parametrize.register_parametrization(site.k_module, "weight", p)
            self._params.append(p)

    @property
    def needs_moments(self) -> bool:
        """Whether the control (or its record) reads the key inputs' covariance."""
        return self.record or (self.mode != "none" and (self.level == "token"
                                                        or self.scale == "data"))

    def remove(self) -> None:
        """Remove the input hooks and a parametrisation (keeping the reshaped weights)."""
        if self.moments is not None:
            self.moments.remove()
        for site in self.sites:
            if parametrize.is_parametrized(site.k_module, "weight"):
                parametrize.remove_parametrizations(site.k_module, "weight",
                                                    leave_parametrized=True)
        self._params = []

    def _rows(self, site: AttentionSite) -> int:
        return site.head_dim if self.scope == "head" else site.n_kv_head * site.head_dim

    def _units(self, site: AttentionSite, w: Tensor) -> Tensor:
        """``w`` as units (U, m, d), detached, float64."""
        return _units_of(site, self.scope, w.detach()).to(torch.float64)

    def measure(self, units: list[Tensor]) -> dict[str, Tensor]:
        """``pr`` (weight level), ``pr_token`` (on Σ_ε), ``pr_token_raw`` (on Σ) and
        ``spread`` of every unit from each site's units (U, m, d) float64; NaN for all but
        ``pr`` while Σ is unknown, and for ``pr_token_oos`` (known one step later)."""
        out = {f: [] for f in FIELDS}
        ready = self.moments is not None and self.moments.ready
        for j, a in enumerate(units):
            out["pr"].append(weight_pr(a).cpu())
            nan = torch.full((a.shape[0],), math.nan, dtype=torch.float64)
            out["pr_token_oos"].append(nan)
            if ready:
                c_eps, c_raw = _token_grams(a, self.moments.covariance(j).to(a.device),
                                            self.moments.ridge(j).to(a.device))
                out["pr_token"].append(pr_from_covariance(c_eps).cpu())
                out["pr_token_raw"].append(pr_from_covariance(c_raw).cpu())
                out["spread"].append(torch.diagonal(c_raw, dim1=-2, dim2=-1).sum(-1).cpu())
            else:
                for f in ("pr_token", "pr_token_raw", "spread"):
                    out[f].append(nan)
        return {f: torch.cat(v) for f, v in out.items()}

    def _out_of_sample(self) -> Tensor:
        """Token-level PR of the keys set by the previous step (:attr:`_prev`) on the inputs
        of the forwards folded now, the batch that trained this step (centred, every
        position, no ε); NaN where either is unknown."""
        out = torch.full((len(self.names),), math.nan, dtype=torch.float64)
        if self.moments is None or self._prev is None:
            return out
        for j, (sl, a) in enumerate(zip(self._slices, self._prev, strict=True)):
            batch = self.moments.batch(j)
            if batch is not None:
                out[sl] = pr_from_covariance(_level_gram(a, batch.to(a.device))[0]).cpu()
        return out

    def _stored_units(self) -> list[Tensor]:
        with torch.no_grad():
            return [self._units(site, site.key_effective()) for site in self.sites]

    def current_pr(self) -> Tensor:
        """PR_K of every unit as the model sees it now, at the control's level (NaN at the
        token level before the first training forward)."""
        if not self.sites:
            return torch.zeros(0, dtype=torch.float64)
        m = self.measure(self._stored_units())
        return m["pr_token" if self.level == "token" else "pr"]

    def _reference_at(self, field: str, step: int) -> Tensor:
        table = self.reference[field]
        if not 0 <= step < table.shape[0]:
            raise QKGeomError(f"the reference run's key PR trajectory ends at step "
                              f"{table.shape[0] - 1}; this run is at step {step}")
        row = table[step]
        if bool(torch.isnan(row).any()):
            raise QKGeomError(f"the reference run recorded no {field} at step {step}: train it "
                              "again with this qkgeom")
        return row

    def spread_target(self, step: int) -> Tensor:
        """The key spread to match at ``step`` (the data rule's reference), else NaN."""
        if self.scale != "data" or self.reference is None or self.mode == "none":
            return torch.full((len(self.names),), math.nan, dtype=torch.float64)
        return self._reference_at("spread", step)

    def hold_level(self) -> Tensor:
        """The PR ``hold`` keeps: PR0 (the monitor's closed loop steers it instead)."""
        return self.pr0

    def _targets(self, idx: Tensor, pr_before: Tensor) -> dict[str, Tensor]:
        """target, sched, base, dose and bound (the target differs from the current PR on
        purpose) of the units ``idx`` at the current step."""
        t = self.step_count
        if self.mode == "hold":
            level = self.hold_level()[idx]
            return {"target": level, "sched": level, "base": level,
                    "bound": torch.ones_like(level, dtype=torch.bool), "dose": 1.0}
        # base(t): the reference run's PR_K at this step and level, or PR0
        base = (self.pr0 if self.reference is None else self._reference_at(
            "pr_token" if self.level == "token" else "pr", t))[idx]
        r = dose_at(t, self.dose, self.ramp_steps)
        sched = r * base
        if self.mode == "sham":  # a placebo: never a cap
            return {"target": pr_before.clone(), "sched": sched, "base": base,
                    "bound": torch.zeros_like(sched, dtype=torch.bool), "dose": r}
        if self.mode == "expand":
            cap = torch.minimum(sched, self._max_pr[idx])
            bound = cap > pr_before
        else:  # shrink
            cap, bound = sched, sched < pr_before
        return {"target": torch.where(bound, cap, pr_before), "sched": sched, "base": base,
                "bound": bound, "dose": r}

    def step(self, step: int | None = None) -> dict[str, float]:
        """Apply the control after optimiser update ``step`` (default: the next); returns
        :meth:`last`."""
        if not self.sites:
            return {}
        self.step_count = self.step_count + 1 if step is None else int(step)
        if self.moments is not None:
            self.moments.fold()
            if not self.moments.ready:
                self.moments.covariance(0)  # raises: no training forward was seen
        if self._w0 is not None and (self.moments is None or self.moments.ready):
            self._settle_step_zero()
        if bool(torch.isnan(self.pr0).any()) and self.mode != "none":
            raise QKGeomError("key control has no step-0 PRs: attach with record_initial=True "
                              "or load_state_dict() from a checkpoint before stepping")
        oos = self._out_of_sample()
        steps, values = self.trajectory
        if self.record and steps and steps[-1] < self.step_count:  # that row is whole now
            values["pr_token_oos"][-1] = oos.clone()
        if self.mode == "none":
            pr = self.current_pr()
            self._last = {"pr": pr, "pr_before": pr}
        elif self.how == "parametrize":
            self._last = self._set_param_targets()
        else:
            self._last = self._project()
        self._last["pr_oos"] = oos
        if self.moments is not None and not self._params:  # else: _set_param_targets
            self._prev = self._stored_units()
        self._window += 1
        if self.record:
            self._append(self.step_count, self.measure(self._stored_units()))
        return self.last()

    def _settle_step_zero(self) -> None:
        """Once Σ is known: the token-level PR0 of the step-0 weights and the step-0 row."""
        m = self.measure(self._w0)
        if self.level == "token":
            self.pr0 = m["pr_token"].clone()
        if self.record and not self.trajectory[0]:
            self._append(0, m)
        self._w0 = None

    def _append(self, step: int, m: dict[str, Tensor]) -> None:
        steps, values = self.trajectory
        steps.append(step)
        for f in FIELDS:
            values[f].append(m[f].clone())

    def _groups(self) -> list[list[int]]:
        """Site indices grouped by unit shape, dtype and device: one batched eigh each."""
        groups: dict[tuple, list[int]] = {}
        for j, site in enumerate(self.sites):
            w = site.key_stored()
            groups.setdefault((self._rows(site), site.d_model, w.dtype, w.device), []).append(j)
        return list(groups.values())

    def _stack_sigma(self, group: list[int], device: torch.device) -> Tensor:
        """Σ (float64) of each unit of the group's sites, (U, d, d)."""
        return torch.stack([self.moments.covariance(j).to(device) for j in group
                            for _ in range(self._slices[j].stop - self._slices[j].start)])

    def _empty_record(self) -> dict[str, Tensor]:
        n = len(self.names)
        return {f: torch.full((n,), math.nan, dtype=torch.float64) for f in _RECORD_FIELDS}

    @torch.no_grad()
    def _project(self) -> dict[str, Tensor]:
        """post_step: rewrite the stored W_K, one batched eigendecomposition per group of
        equally shaped units (docs/definitions.md#post-step-or-parametrize)."""
        rec = self._empty_record()
        spread_target = self.spread_target(self.step_count)
        for group in self._groups():
            self._project_group(group, spread_target, rec)
        return rec

    def _project_group(self, group: list[int], spread_target: Tensor,
                       rec: dict[str, Tensor]) -> None:
        """Reshape the units that need it (hold, sham: all; shrink, expand: those whose cap
        binds), rescale every rewritten unit (with a matched spread: every unit), write them
        in place and record the PR and spread re-measured on the stored weights."""
        sites = [self.sites[j] for j in group]
        idx = torch.cat([torch.arange(self._slices[j].start, self._slices[j].stop)
                         for j in group])  # unit indices, in stacking order
        a_stored = torch.cat([self._raw_units(site) for site in sites])  # (U, m, d)
        a, dev = a_stored.to(torch.float64), a_stored.device
        s_raw = ridge = s_eps = None
        if self.moments is not None:
            s_raw = self._stack_sigma(group, dev)
            ridge = torch.cat([self.moments.ridge(j).to(dev).expand(
                self._slices[j].stop - self._slices[j].start) for j in group])
            if self.level == "token":
                s_eps = s_raw + ridge[:, None, None] * torch.eye(
                    s_raw.shape[-1], dtype=s_raw.dtype, device=dev)
        s_keep = s_raw if self.scale == "data" else None
        gram, left = _level_gram(a, s_eps)
        pr_before = pr_from_covariance(gram).cpu()  # (U,)
        tg = self._targets(idx, pr_before)
        target, gamma = tg["target"].clone(), torch.ones_like(pr_before)
        clamped = torch.zeros_like(pr_before)
        new, act = a.clone(), torch.zeros_like(tg["bound"])
        sub = torch.nonzero(tg["bound"] | (self.mode == "sham")).flatten()
        if len(sub):
            fit, moved, w_new = self._reshape(a[sub.to(dev)], gram[sub.to(dev)], target[sub],
                                              ~tg["bound"][sub], left, a_stored.dtype)
            target[sub] = torch.where(fit.flat, pr_before[sub], fit.target)
            gamma[sub], clamped[sub] = fit.gamma, fit.clamped.to(torch.float64)
            new[sub.to(dev)], act[sub] = w_new, moved
        matched = torch.isfinite(spread_target[idx])
        act = act | matched  # a matched spread rescales every unit, every step
        if bool(act.any()):
            sel = torch.nonzero(act).flatten().to(dev)
            s_sel = None if s_keep is None else s_keep[sel]
            c = _keep_scale(spread_target[idx][act].to(dev), a[sel], new[sel], s_sel)
            stored = (new[sel] * c[:, None, None]).to(a_stored.dtype)
            self._write(group, torch.nonzero(act).flatten().tolist(), stored, idx)
            self.reshapes += int(act.sum())
        after = torch.cat([self._raw_units(site) for site in sites]).to(torch.float64)
        self._note(rec, idx, tg, after, s_raw, ridge, s_keep is not None, target=target,
                   pr_before=pr_before, gamma=gamma, clamped=clamped,
                   spread_target=spread_target[idx])

    def _note(self, rec: dict[str, Tensor], idx: Tensor, tg: dict[str, Tensor], after: Tensor,
              s_raw: Tensor | None, ridge: Tensor | None, spread: bool,
              **fields: Tensor) -> None:
        """Record the step of units ``idx`` (``after``: their weights now, float64) and
        count the steps where the cap bound (hold: where the reshape moved the spectrum).
        ``pr`` is at the control's level, at the token level on its own Σ_ε = ``s_raw`` +
        ``ridge``·I (on target by construction); ``pr_raw`` the token-level PR on Σ without
        ε and ``spread`` (when asked) tr(W Σ Wᵀ); both NaN without Σ."""
        hit = (fields["gamma"] != 1) if self.mode == "hold" else tg["bound"]
        self._bound[idx] += hit.to(torch.float64)
        nan = torch.full((len(idx),), math.nan, dtype=torch.float64)
        pr_raw = spread_now = nan
        if s_raw is not None:
            c_eps, c_raw = _token_grams(after, s_raw, ridge)
            pr_raw = pr_from_covariance(c_raw).cpu()
            if spread:
                spread_now = torch.diagonal(c_raw, dim1=-2, dim2=-1).sum(-1).cpu()
        if self.level == "token":
            pr = pr_from_covariance(c_eps).cpu()
        else:
            pr = pr_from_covariance(_level_gram(after, None)[0]).cpu()
        for f, v in {**fields, "sched": tg["sched"], "base": tg["base"], "dose": tg["dose"],
                     "pr": pr, "pr_raw": pr_raw, "spread": spread_now}.items():
            rec[f][idx] = v

    def _reshape(self, a: Tensor, gram: Tensor, target: Tensor, keep: Tensor, left: bool,
                 stored: torch.dtype) -> tuple[Any, Tensor, Tensor]:
        """(fit, moved, W″): units ``a`` (U, m, d) float64 reshaped through the eigenvalues
        of ``gram``, W″ = U·diag(s′/s)·Uᵀ·W (``left``) or W·U·diag(s′/s)·Uᵀ, unscaled;
        ``moved``: γ ≠ 1 or sham, never flat; ``keep``: target = current PR, so γ = 1
        exactly. Values below 2·rtol·s_max are floored, never deleted (a sham step must be
        a round trip); the eigh runs in float32 above 32 × 32 (cheaper, and CUDA has no fast
        float64 solver), enough for the float64 re-measured invariants."""
        r = gram.shape[-1]
        g = gram.to(torch.float64 if r <= 32 else torch.float32)
        norm = torch.diagonal(g, dim1=-2, dim2=-1).amax(-1).clamp_min(1e-30)  # (U,)
        lam, vec = torch.linalg.eigh(g / norm[:, None, None])  # ascending
        lam = (lam.flip(-1).to(torch.float64) * norm.to(torch.float64)[:, None]).cpu()
        vec = vec.flip(-1)
        rtol = default_rtol(r, stored)
        floor = (2 * rtol) ** 2 * lam[:, :1].clamp_min(0)
        s = torch.maximum(lam, floor).sqrt()  # (U, r) singular values, none below the floor
        target = torch.where(keep, participation_ratio(s * s), target)
        fit = fit_spectrum(s, target, rtol=rtol)
        moved = ~fit.flat & ((fit.gamma != 1) | (self.mode == "sham"))
        ratio = torch.where(s > 0, fit.s / torch.where(s > 0, s, torch.ones_like(s)),
                            torch.zeros_like(s))
        ratio = torch.where(moved[:, None], ratio, torch.ones_like(ratio))
        mix = (vec * ratio.to(vec)[:, None, :]) @ vec.mT  # U·diag(s′/s)·Uᵀ, (U, r, r)
        a_c = a.to(mix.dtype)
        new = (mix @ a_c if left else a_c @ mix).to(torch.float64)
        return fit, moved, torch.where(moved[:, None, None].to(a.device), new, a)

    def _write(self, group: list[int], units: list[int], new: Tensor, idx: Tensor) -> None:
        """Copy rewritten units (positions ``units`` in the group's stacking) into W_K."""
        pos = {int(idx[u]): k for k, u in enumerate(units)}
        for j in group:
            site, sl = self.sites[j], self._slices[j]
            view = site.k_heads(site.key_stored())  # (H_kv, hd, d) view, in place
            for g in pos.keys() & range(sl.start, sl.stop):
                unit = view[g - sl.start] if self.scope == "head" else view
                unit.copy_(new[pos[g]].view(unit.shape))

    def _raw_units(self, site: AttentionSite) -> Tensor:
        """A copy of the stored W_K of a site as units, in the stored dtype."""
        return _units_of(site, self.scope, site.key_stored().detach()).clone()

    def _set_param_targets(self) -> dict[str, Tensor]:
        """parametrize: set each parametrisation's targets for the coming forward passes."""
        rec = self._empty_record()
        spread_target = self.spread_target(self.step_count)
        prev = []
        with torch.no_grad():
            for j, (site, sl, p) in enumerate(zip(self.sites, self._slices, self._params,
                                                  strict=True)):
                idx = torch.arange(sl.start, sl.stop)
                dev = site.key_stored().device
                s_eps = self.moments.regularised(j).to(dev) if self.level == "token" else None
                s_units = None if s_eps is None else s_eps.expand(len(idx), -1, -1)
                original = self._units(site, site.key_stored())  # unconstrained
                pr_before = pr_from_covariance(_level_gram(original, s_units)[0]).cpu()
                tg = self._targets(idx, pr_before)
                identity = ~tg["bound"] & torch.as_tensor(self.mode != "sham")
                p.target.copy_(tg["target"])
                p.identity.copy_(identity)
                p.spread.copy_(spread_target[idx])
                if self.moments is not None:
                    p.moment = self.moments.covariance(j).to(dev)
                if s_eps is not None:
                    p.root, p.iroot = _sqrt_pair(s_eps)
                effective = self._units(site, site.key_effective())  # runs the reshape
                prev.append(effective)
                gamma, clamped = p.last_gamma.cpu(), p.last_clamped.cpu()
                self.reshapes += int((~identity | torch.isfinite(spread_target[idx])).sum())
                s_raw = None if p.moment is None else p.moment.expand(len(idx), -1, -1)
                ridge = None if s_raw is None else self.moments.ridge(j).to(dev)
                self._note(rec, idx, tg, effective, s_raw, ridge, s_raw is not None,
                           target=tg["target"],
                           pr_before=pr_before,
                           gamma=torch.where(identity, torch.ones_like(gamma), gamma),
                           clamped=(clamped & ~identity).to(torch.float64),
                           spread_target=spread_target[idx])
        if self.moments is not None:
            self._prev = prev
        return rec

    def _initial_record(self) -> dict[str, Tensor]:
        """The step-0 records (token level: NaN until the first forward gives Σ)."""
        n = len(self.names)
        if self.mode == "none":
            return {"pr": self.pr0.clone(), "pr_before": self.pr0.clone()}
        return {"target": self.pr0.clone(), "pr": self.pr0.clone(),
                "pr_before": self.pr0.clone(), "gamma": torch.ones(n, dtype=torch.float64),
                "clamped": torch.zeros(n, dtype=torch.float64)}

    def last(self) -> dict[str, float]:
        """The last step's records as ``{"ctl_<field>_<unit>": value}`` (unit ``l3`` or
        ``l3h1``; docs/definitions.md#what-is-recorded), undefined values left out; {} for
        mode ``none``. ``bound_share`` counts the steps since :meth:`reset_window`."""
        if self.mode == "none":
            return {}
        rec = dict(self._last)
        rec["bound_share"] = (self._bound / self._window if self._window
                              else torch.full_like(self._bound, math.nan))
        out: dict[str, float] = {}
        for f in _RECORD_FIELDS:
            if f in rec:  # one conversion per field, not one per unit; NaN = not defined
                out.update((f"ctl_{f}_{name}", v) for name, v in
                           zip(self.names, map(float, rec[f].tolist()), strict=True)
                           if not math.isnan(v))
        return out

    def reset_window(self) -> None:
        """Start a new window for ``bound_share`` (call after reading :meth:`last`)."""
        self._bound.zero_()
        self._window = 0

    def targets(self) -> dict[str, float]:
        """``{"ctl_target_<unit>": PR aimed at in the last step}``."""
        return {k: v for k, v in self.last().items() if k.startswith("ctl_target_")}

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "mode": self.mode, "level": self.level,
                "scope": self.scope, "scale": self.scale, "arch": self.arch,
                "names": list(self.names), "pr0": [float(v) for v in self.pr0],
                "w0": None if self._w0 is None else [u.cpu().clone() for u in self._w0],
                "prev": None if self._prev is None else [u.cpu().clone() for u in self._prev],
                "step": int(self.step_count),
                "last": {f: [float(x) for x in v] for f, v in self._last.items()},
                "bound": [float(v) for v in self._bound], "window": int(self._window),
                "reshapes": int(self.reshapes),
                "moments": self.moments.state_dict() if self.moments is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore PR0, the counters, the input moments and the last records (the
        trajectory is restored by the callback, from the run's key_pr.parquet)."""
        if not state:
            raise QKGeomError("empty key-control state: the checkpoint was written without "
                              "key control")
        if state.get("version") not in _READS:
            raise QKGeomError(f"saved key-control state version {state.get('version')!r}; "
                              f"this qkgeom reads {' and '.join(map(str, _READS))}: train "
                              "the run again")
        for key in ("mode", "level", "scope", "scale", "names"):
            if state.get(key) != getattr(self, key):
                raise QKGeomError(f"saved key-control {key} {state.get(key)!r} does not match "
                                  f"this run's {getattr(self, key)!r}")
        pr0 = torch.tensor(state["pr0"], dtype=torch.float64)
        w0 = state.get("w0")
        if self.names and self.mode != "none" and w0 is None and not bool(
                torch.isfinite(pr0).all()):
            raise QKGeomError("saved key-control state has no valid step-0 PRs")
        self.pr0 = pr0
        self._w0 = None if w0 is None else [torch.as_tensor(u, dtype=torch.float64).to(
            site.key_stored().device) for u, site in zip(w0, self.sites, strict=True)]
        prev = state.get("prev")
        self._prev = None if prev is None else [torch.as_tensor(u, dtype=torch.float64).to(
            site.key_stored().device) for u, site in zip(prev, self.sites, strict=True)]
        self.step_count = int(state["step"])
        self._bound = torch.tensor(state["bound"], dtype=torch.float64)
        self._window = int(state["window"])
        self.reshapes = int(state["reshapes"])
        if self.moments is not None:
            self.moments.load_state_dict(state["moments"] or [None] * len(self.sites))
        if self.how == "parametrize" and self._params and self.step_count > 0:
            bound, window, reshapes = self._bound.clone(), self._window, self.reshapes
            self._set_param_targets()  # targets of the saved step, for the coming forwards
            self._bound, self._window, self.reshapes = bound, window, reshapes
        # keep the saved records: they describe the step the checkpoint was taken at
        self._last = {f: torch.tensor(v, dtype=torch.float64)
                      for f, v in state.get("last", {}).items()}
