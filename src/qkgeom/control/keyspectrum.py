"""Key-spectrum control during training (experiment E3; docs/definitions.md#key-spectrum-control).

:meth:`KeySpectrumControl.attach` finds the key projection W_K of every layer of a model
(any family :mod:`qkgeom.arch` supports: the project's GPT, Hugging Face GPT-2,
GPT-NeoX/Pythia, Llama-style and BERT-style models) and, after each optimiser step
(``how="post_step"``) or inside every forward pass (``how="parametrize"``), reshapes each
controlled unit -- a whole layer's W_K (``scope="layer"``, d_k × d_model) or each head's
slice (``scope="head"``, d_head × d_model) -- so that a spectrum has its target PR, then
rescales it by the scale rule.

**Level** (which spectrum is reshaped):

* ``token``: that of the keys the attention sees on its inputs, C = W Σ_ε Wᵀ with Σ_ε the
  regularised running covariance of the key projection's input
  (:mod:`qkgeom.control.moments`). With C = U·diag(s²)·Uᵀ the new weight is
  W′ = U·diag(s′/s)·Uᵀ·W (s′ᵢ ∝ sᵢ^γ), whose key covariance W′ Σ_ε W′ᵀ = U·diag(s′²)·Uᵀ
  has exactly the target PR: the reshape of W Σ_ε^½ mapped back, written without Σ^−½.
* ``weight``: that of W_K itself (C = W Wᵀ, or Wᵀ W for a tall unit).

Targets per unit, at the control's level, with PR0 = the unit's PR at step 0 (token level:
W at step 0 on the first training batch), base(t) = the reference run's PR at step t
(``reference``) or PR0, and r(t) going linearly from 1 at step 0 to ``dose`` at
``ramp_steps`` (:func:`dose_at`):

* ``none``: nothing at all -- no SVD, no writes, training is bit-identical (with
  ``record`` it measures PR_K and the key spread after each step, and never writes).
* ``hold``: PR0, in both directions.
* ``shrink``: min(current PR, r(t)·base(t)): a cap that only ever lowers PR.
* ``sham``: the current PR, always: the same decomposition, round trip and rescale every
  other arm gets, at every step, never a cap -- a placebo whose weights change by round-off
  (and by the matched scale, below) only.
* ``expand``: max(current PR, r(t)·base(t)), capped at the largest PR, min(rows, d_model).

**Scale rule** (the factor c of every rewritten unit, computed from the rewritten matrix
itself, so it holds to round-off): ``frobenius`` keeps ‖W_K‖_F of the unit; ``data`` sets
the key spread tr(W Σ Wᵀ) = E‖k − E k‖² (Σ unregularised) to the reference run's spread at
the same step when there is a reference -- then every unit is rescaled at every step, so
the arm's keys are exactly as spread out as the uncontrolled run's -- and else keeps it
through the reshape.

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
from qkgeom.control.trajectory import FIELDS, reference_table
from qkgeom.errors import QKGeomError
from qkgeom.geometry.spectra import participation_ratio, pr_from_covariance, weight_pr

__all__ = [
    "HOWS",
    "LEVELS",
    "MODES",
    "SCALES",
    "SCOPES",
    "KeySpectrumControl",
    "KeySpectrumParametrization",
    "dose_at",
]

MODES = KeyControlConfig.MODES
LEVELS = KeyControlConfig.LEVELS
SCALES = KeyControlConfig.SCALES
SCOPES = KeyControlConfig.SCOPES
HOWS = KeyControlConfig.HOWS
_STATE_VERSION = 3
_RECORD_FIELDS = ("target", "sched", "base", "dose", "pr", "pr_before", "gamma", "clamped",
                  "bound_share", "spread", "spread_target")


def dose_at(step: int, dose: float, ramp_steps: int) -> float:
    """r(t): 1 at step 0, linear to ``dose`` at ``ramp_steps``, then ``dose`` (at once for a
    ramp of 0)."""
    frac = 1.0 if ramp_steps <= 0 else min(max(step / ramp_steps, 0.0), 1.0)
    return 1.0 + (dose - 1.0) * frac


def _eigh_dtype(device: torch.device, r: int) -> torch.dtype:
    """The precision of the batched eigendecomposition of (U, r, r) Gram matrices.

    float64 for r <= 32 (cheap everywhere; CUDA's batched Jacobi solver covers it) and
    float32 above (half the cost on CPU; no slow float64 solvers on CUDA). Enough for the
    invariants: the reshape is a smooth matrix function whose per-step change is small,
    the reshaped units' PR is re-measured in float64 (on target within 1e-3) and the scale
    factor is computed from the reshaped matrix in float64.
    """
    return torch.float64 if r <= 32 else torch.float32


def _quad_trace(a: Tensor, s: Tensor | None) -> Tensor:
    """tr(A S Aᵀ) per unit (``S`` None: ‖A‖_F²); a (U, m, d), s (U, d, d), float64."""
    return (a * a if s is None else (a @ s) * a).sum(dim=(-2, -1))


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


def _sqrt_pair(s_eps: Tensor) -> tuple[Tensor, Tensor]:
    """(Σ_ε^½, Σ_ε^−½) of a symmetric positive definite (d, d) matrix, float64."""
    lam, vec = torch.linalg.eigh(s_eps)
    root = lam.clamp_min(torch.finfo(lam.dtype).tiny).sqrt()
    return (vec * root) @ vec.mT, (vec / root) @ vec.mT


class KeySpectrumParametrization(nn.Module):
    """``forward(W)`` = W with its key (per layer or per head) reshaped to PR = ``target``.

    The ``torch.nn.utils.parametrize`` idiom: the stored parameter is the unconstrained
    ``original``; the model sees the reshaped weight, and gradients flow through the
    reshape (:func:`~qkgeom.control.spectrum.spectral_reshape`) and the scale factor. At the
    token level the reshaped matrix is W Σ_ε^½, mapped back by Σ_ε^−½. The non-persistent
    buffers -- ``target``, ``identity`` (units passed through, e.g. a shrink cap above the
    current PR), ``moment`` (Σ of the data rule), ``root``/``iroot`` (Σ_ε^±½, token level)
    and ``spread`` (the key spread to match, NaN: keep it) -- are set by
    :class:`KeySpectrumControl` after each step. For fused q/k/v weights only the key
    slice changes.
    """

    def __init__(self, site: AttentionSite, scope: str, level: str, scale: str,
                 target: Tensor) -> None:
        super().__init__()
        self.site, self.scope, self.level, self.scale = site, scope, level, scale
        n_units = site.n_kv_head if scope == "head" else 1
        self.register_buffer("target", torch.as_tensor(target, dtype=torch.float64)
                             .reshape(n_units).clone(), persistent=False)
        self.register_buffer("identity", torch.zeros(n_units, dtype=torch.bool),
                             persistent=False)
        self.register_buffer("spread", torch.full((n_units,), math.nan, dtype=torch.float64),
                             persistent=False)
        for name in ("moment", "root", "iroot"):
            self.register_buffer(name, None, persistent=False)
        self.last_gamma: Tensor | None = None
        self.last_clamped: Tensor | None = None

    def forward(self, w: Tensor) -> Tensor:
        heads = self.site.k_heads(w)  # (H_kv, hd, d)
        k = heads if self.scope == "head" else heads.reshape(1, -1, self.site.d_model)  # (U, m, d)
        if self.level == "token" and self.root is not None:
            root = self.root.to(k.dtype)
            m_new, gamma, _, clamped = spectral_reshape(k @ root, self.target, self.identity)
            k_new = torch.where(self.identity[:, None, None], k, m_new @ self.iroot.to(k.dtype))
        else:
            k_new, gamma, _, clamped = spectral_reshape(k, self.target, self.identity)
        k64, new64 = k.to(torch.float64), k_new.to(torch.float64)
        if self.scale == "data" and self.moment is not None:
            s = self.moment.expand(k.shape[0], -1, -1)
            kept = torch.where(torch.isfinite(self.spread), self.spread, _quad_trace(k64, s))
            c = torch.sqrt(kept / _quad_trace(new64, s).clamp_min(1e-300))
            k_new = k_new * c.to(k_new.dtype)[:, None, None]
        elif self.scale == "frobenius" and self.level == "token":  # the reshape kept ‖W Σ^½‖
            c = torch.sqrt(_quad_trace(k64, None) / _quad_trace(new64, None).clamp_min(1e-300))
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

    Build it with :meth:`attach`. Call :meth:`step` after every optimiser step (the input
    hooks collect the key inputs during your training forward passes, so Σ starts from the
    first one); read :meth:`last` (flat dict of the records) for logging and
    :meth:`reset_window` after each read. ``state_dict`` keeps PR0, the step counter, the
    bound counters and the input moments, so a resumed run continues bit for bit.
    """

    def __init__(self, model: nn.Module, arch: str, sites: list[AttentionSite], *, mode: str,
                 level: str, scope: str, scale: str, dose: float, ramp_steps: int, how: str,
                 record: bool) -> None:
        self.model, self.arch, self.sites = model, arch, sites
        self.mode, self.level, self.scope, self.scale, self.how = mode, level, scope, scale, how
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
        self._w0: list[Tensor] | None = None  # step-0 units until PR0 (token level) is known
        self.reference: dict[str, Tensor] | None = None  # field -> (last step + 1, units)
        self.step_count = 0
        self.reshapes = 0  # units rewritten so far (sham: every unit at every step)
        self._bound = torch.zeros(n, dtype=torch.float64)  # steps the cap bound, this window
        self._window = 0  # steps since the last reset_window()
        self._last: dict[str, Tensor] = {}
        self._params: list[KeySpectrumParametrization] = []
        self.moments: InputMoments | None = None
        self.trajectory: tuple[list[int], dict[str, list[Tensor]]] = (
            [], {f: [] for f in FIELDS})  # record: steps and per-step fields

    # ----------------------------------------------------------------- construction

    @classmethod
    def attach(cls, model: nn.Module, mode: str = "hold", *, level: str = "token",
               scope: str = "layer", scale: str = "data", dose: float | None = None,
               ramp_steps: int = 0, reference: str | Path | None = None,
               how: str = "post_step", layers: Iterable[int] | None = None,
               record: bool = False, record_initial: bool = True) -> KeySpectrumControl:
        """Validate, find the key weights, note the step-0 weights and (``parametrize``)
        register.

        Args:
            model: the project's GPT or a supported HF model (see module docstring).
            mode: one of :data:`MODES`; ``"none"`` touches nothing (without ``record`` not
                even the lookup).
            level: ``"token"`` (the keys' covariance on the layer's inputs) or ``"weight"``
                (W_K itself).
            scope: ``"layer"`` (whole W_K) or ``"head"`` (each head's slice).
            scale: ``"data"`` (the key spread on the layer's inputs: the reference run's at
                the same step, else kept) or ``"frobenius"`` (keep ‖W_K‖_F).
            dose: r, the final cap as a multiple of base(t): shrink (0, 1] (default 0.5),
                expand >= 1 (default 2), sham 1; hold takes none.
            ramp_steps: steps over which r(t) goes from 1 to ``dose`` (0: at once).
            reference: a run folder with a ``key_pr.parquet`` (trained with
                ``key_control.record``): base(t) is its PR_K at step t at this level, and the
                data rule matches its key spread; None: PR0 and a kept spread.
            how: ``"post_step"`` (project after each :meth:`step`) or ``"parametrize"``.
            layers: layer indices to control (default all).
            record: keep every step's PR_K (both levels) and key spread in
                :attr:`trajectory`.
            record_initial: take PR0 from the weights now (a fresh run at step 0). Pass
                False when the state comes from :meth:`load_state_dict` (resume).
        Raises:
            QKGeomError: bad arguments or an unsupported architecture.
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
            with torch.no_grad():
                ctl._w0 = [ctl._units(site, site.key_effective()) for site in sites]
            if level == "weight":
                ctl.pr0 = torch.cat([weight_pr(u).cpu() for u in ctl._w0])
            ctl._last = ctl._initial_record()
        if mode != "none" and how == "parametrize":
            ctl._register_parametrizations()
        return ctl

    def _register_parametrizations(self) -> None:
        """``how="parametrize"``: W_K becomes a function of the stored weight, the identity
        until the first step sets targets."""
        for site, sl in zip(self.sites, self._slices, strict=True):
            p = KeySpectrumParametrization(site, self.scope, self.level, self.scale,
                                           torch.ones(sl.stop - sl.start))
            p.identity.fill_(True)
            p.to(site.key_stored().device)
            parametrize.register_parametrization(site.k_module, "weight", p)
            self._params.append(p)

    @property
    def needs_moments(self) -> bool:
        """Whether the control (or its record) reads the key inputs' covariance."""
        return self.record or (self.mode != "none" and (self.level == "token"
                                                        or self.scale == "data"))

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

    def _sigma(self, j: int, regularised: bool) -> Tensor:
        """Σ (or Σ_ε) of site ``j``, float64, on the weights' device."""
        return self.moments.regularised(j) if regularised else self.moments.covariance(j)

    def measure(self, units: list[Tensor]) -> dict[str, Tensor]:
        """``pr`` (weight level), ``pr_token`` and ``spread`` of every unit, from the units
        of each site (``units[j]``: (U, m, d) float64); NaN for the last two while Σ is
        unknown."""
        out = {f: [] for f in FIELDS}
        ready = self.moments is not None and self.moments.ready
        for j, a in enumerate(units):
            out["pr"].append(weight_pr(a).cpu())
            if ready:
                s = self._sigma(j, False).to(a.device)
                gram, _ = _level_gram(a, self._sigma(j, True).to(a.device))
                out["pr_token"].append(pr_from_covariance(gram).cpu())
                out["spread"].append(_quad_trace(a, s.expand(a.shape[0], -1, -1)).cpu())
            else:
                nan = torch.full((a.shape[0],), math.nan, dtype=torch.float64)
                out["pr_token"].append(nan)
                out["spread"].append(nan.clone())
        return {f: torch.cat(v) for f, v in out.items()}

    def _stored_units(self) -> list[Tensor]:
        with torch.no_grad():
            return [self._units(site, site.key_effective()) for site in self.sites]

    def current_pr(self) -> Tensor:
        """PR_K of every controlled unit as the model sees it now, at the control's level
        (float64, (N,); NaN at the token level before the first training forward)."""
        if not self.sites:
            return torch.zeros(0, dtype=torch.float64)
        m = self.measure(self._stored_units())
        return m["pr_token" if self.level == "token" else "pr"]

    def base_at(self, step: int) -> Tensor:
        """base(t) of every unit: the reference run's PR_K at ``step`` (at this level), or
        PR0."""
        if self.reference is None:
            return self.pr0
        return self._reference_at("pr_token" if self.level == "token" else "pr", step)

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
        """The key spread each unit is rescaled to at ``step``: the reference run's (data
        rule with a reference), else NaN (keep the unit's own)."""
        n = len(self.names)
        if self.scale != "data" or self.reference is None or self.mode == "none":
            return torch.full((n,), math.nan, dtype=torch.float64)
        return self._reference_at("spread", step)

    def hold_level(self) -> Tensor:
        """The PR ``hold`` keeps each unit at: PR0. A subclass may move it (the monitor's
        closed loop steers it toward a target attention entropy)."""
        return self.pr0

    def _targets(self, idx: Tensor, pr_before: Tensor) -> dict[str, Tensor]:
        """target, sched (the cap before the current-PR bound), base, bound (the target
        differs from the current PR on purpose) for the units ``idx`` at the current step."""
        t = self.step_count
        if self.mode == "hold":
            level = self.hold_level()[idx]
            return {"target": level, "sched": level, "base": level,
                    "bound": torch.ones_like(level, dtype=torch.bool), "dose": 1.0}
        base = self.base_at(t)[idx]
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

    # ----------------------------------------------------------------- stepping

    def step(self, step: int | None = None) -> dict[str, float]:
        """Apply the control after an optimiser step; returns :meth:`last`.

        ``step`` is the number of optimiser updates done (default: one more than last
        time); it sets where on the ramp and the reference trajectory the targets are.
        """
        if not self.sites:
            return {}
        self.step_count = self.step_count + 1 if step is None else int(step)
        if self.moments is not None:
            self.moments.fold()
            if self.needs_moments and not self.moments.ready:
                self.moments.covariance(0)  # raises: no training forward was seen
        if self._w0 is not None and (self.moments is None or self.moments.ready):
            self._settle_step_zero()
        if bool(torch.isnan(self.pr0).any()) and self.mode != "none":
            raise QKGeomError("key control has no step-0 PRs: attach with record_initial=True "
                              "or load_state_dict() from a checkpoint before stepping")
        if self.mode == "none":
            m = self.measure(self._stored_units())
            pr = m["pr_token" if self.level == "token" else "pr"]
            self._last = {"pr": pr, "pr_before": pr}
        elif self.how == "parametrize":
            self._last = self._set_param_targets()
        else:
            self._last = self._project()
        self._window += 1
        if self.record:
            self._append(self.step_count, self.measure(self._stored_units()))
        return self.last()

    def _settle_step_zero(self) -> None:
        """Once Σ is known (after the first training forward, on the step-0 weights): the
        token-level PR0 and, with ``record``, the step-0 row of the trajectory."""
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
            rows = site.head_dim if self.scope == "head" else site.n_kv_head * site.head_dim
            groups.setdefault((rows, site.d_model, w.dtype, w.device), []).append(j)
        return list(groups.values())

    def _stack_sigma(self, group: list[int], regularised: bool, device: torch.device
                     ) -> Tensor | None:
        """Σ (or Σ_ε) of each unit of the group's sites, (U, d, d); None without moments."""
        if self.moments is None:
            return None
        mats = [self._sigma(j, regularised).to(device)
                for j in group for _ in range(self._slices[j].stop - self._slices[j].start)]
        return torch.stack(mats)

    @torch.no_grad()
    def _project(self) -> dict[str, Tensor]:
        """post_step: per group of equally shaped units, the level's Gram matrices and PRs,
        the targets; then -- only for the units that need it (hold and sham: all; shrink and
        expand: those whose cap binds) -- one batched eigendecomposition
        (:func:`_eigh_dtype`), the fit of γ, ``W″ = U·diag(s′/s)·Uᵀ·W`` (right-multiplied
        for a tall weight-level unit); the scale factor c of every unit that is rewritten
        (with a matched spread: every unit); in-place writes; the achieved PR and spread
        re-measured on the stored weights.

        Singular values are floored at 2·rtol·s_max before the fit, so none is treated as
        zero: the Gram route resolves them only down to about √eps·s_max, and a value that
        is small but real must be rescaled, not deleted (a sham step must be a round trip).
        """
        n = len(self.names)
        rec = {f: torch.full((n,), math.nan, dtype=torch.float64) for f in _RECORD_FIELDS}
        spread_target = self.spread_target(self.step_count)
        for group in self._groups():
            sites = [self.sites[j] for j in group]
            idx = torch.cat([torch.arange(self._slices[j].start, self._slices[j].stop)
                             for j in group])  # unit indices, in stacking order
            a_stored = torch.cat([self._raw_units(site) for site in sites])  # (U, m, d)
            a = a_stored.to(torch.float64)
            dev = a.device
            s_eps = self._stack_sigma(group, True, dev) if self.level == "token" else None
            s_keep = self._stack_sigma(group, False, dev) if self.scale == "data" else None
            gram, left = _level_gram(a, s_eps)
            pr_before = pr_from_covariance(gram).cpu()  # (U,)
            tg = self._targets(idx, pr_before)
            reshape = tg["bound"] | (self.mode == "sham")
            matched = torch.isfinite(spread_target[idx])
            target, gamma = tg["target"].clone(), torch.ones_like(pr_before)
            clamped = torch.zeros_like(pr_before)
            new, act = a.clone(), torch.zeros_like(reshape)
            if bool(reshape.any()):
                sub = torch.nonzero(reshape).flatten()
                fit, moved, w_new = self._reshape(a[sub.to(dev)], gram[sub.to(dev)], target[sub],
                                                  ~tg["bound"][sub], left, a_stored.dtype)
                target[sub] = torch.where(fit.flat, pr_before[sub], fit.target)
                gamma[sub] = fit.gamma
                clamped[sub] = fit.clamped.to(torch.float64)
                new[sub.to(dev)] = w_new
                act[sub] = moved
            act = act | matched  # a matched spread rescales every unit, every step
            if bool(act.any()):
                sel = torch.nonzero(act).flatten().to(dev)
                s_sel = None if s_keep is None else s_keep[sel]
                kept = torch.where(matched[act].to(dev), spread_target[idx][act].to(dev),
                                   _quad_trace(a[sel], s_sel))
                c = torch.sqrt(kept / _quad_trace(new[sel], s_sel).clamp_min(1e-300))
                stored = (new[sel] * c[:, None, None]).to(a_stored.dtype)
                self._write(group, torch.nonzero(act).flatten().tolist(), stored, idx)
                self.reshapes += int(act.sum())
            after = torch.cat([self._raw_units(site) for site in sites]).to(torch.float64)
            gram_after, _ = _level_gram(after, s_eps)
            pr_after = pr_from_covariance(gram_after).cpu()
            spread_after = (_quad_trace(after, s_keep).cpu() if s_keep is not None
                            else torch.full_like(pr_after, math.nan))
            hit = (gamma != 1) if self.mode == "hold" else tg["bound"]
            self._bound[idx] += hit.to(torch.float64)
            for f, v in (("target", target), ("sched", tg["sched"]), ("base", tg["base"]),
                         ("dose", tg["dose"]), ("pr_before", pr_before), ("gamma", gamma),
                         ("clamped", clamped), ("pr", pr_after), ("spread", spread_after),
                         ("spread_target", spread_target[idx])):
                rec[f][idx] = v
        return rec

    def _reshape(self, a: Tensor, gram: Tensor, target: Tensor, keep: Tensor, left: bool,
                 stored: torch.dtype) -> tuple[Any, Tensor, Tensor]:
        """(fit, moved, W″) for units ``a`` (U, m, d) float64 whose controlled spectrum is
        the eigenvalues of ``gram``: W″ = U·diag(s′/s)·Uᵀ·W (``left``) or W·U·diag(s′/s)·Uᵀ,
        unscaled. ``moved`` marks the units rewritten (γ ≠ 1, or any sham unit; never a
        flat one). ``keep`` marks units whose target is their current PR (the sham): γ = 1
        exactly, whatever the PR of the computed eigenvalues."""
        r = gram.shape[-1]
        dtype = _eigh_dtype(a.device, r)
        g = gram.to(dtype)
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
        rec = {f: torch.full((n,), math.nan, dtype=torch.float64) for f in _RECORD_FIELDS}
        spread_target = self.spread_target(self.step_count)
        with torch.no_grad():
            for j, (site, sl, p) in enumerate(zip(self.sites, self._slices, self._params,
                                                  strict=True)):
                idx = torch.arange(sl.start, sl.stop)
                dev = site.key_stored().device
                original = self._units(site, site.key_stored())  # unconstrained
                s_eps = self._sigma(j, True).to(dev) if self.level == "token" else None
                pr_before = pr_from_covariance(_level_gram(
                    original, None if s_eps is None else s_eps.expand(len(idx), -1, -1))[0]).cpu()
                tg = self._targets(idx, pr_before)
                identity = ~tg["bound"] & torch.as_tensor(self.mode != "sham")
                p.target.copy_(tg["target"])
                p.identity.copy_(identity)
                p.spread.copy_(spread_target[idx])
                if self.moments is not None:
                    p.moment = self._sigma(j, False).to(dev)
                if s_eps is not None:
                    p.root, p.iroot = _sqrt_pair(s_eps)
                effective = self._units(site, site.key_effective())  # runs the reshape
                gamma, clamped = p.last_gamma.cpu(), p.last_clamped.cpu()
                hit = (gamma != 1) if self.mode == "hold" else tg["bound"]
                self._bound[idx] += hit.to(torch.float64)
                self.reshapes += int((~identity | torch.isfinite(spread_target[idx])).sum())
                gram_after, _ = _level_gram(
                    effective, None if s_eps is None else s_eps.expand(len(idx), -1, -1))
                spread = (_quad_trace(effective, p.moment.expand(len(idx), -1, -1)).cpu()
                          if p.moment is not None else torch.full((len(idx),), math.nan,
                                                                  dtype=torch.float64))
                for f, v in (("target", tg["target"]), ("sched", tg["sched"]),
                             ("base", tg["base"]), ("dose", tg["dose"]),
                             ("pr_before", pr_before),
                             ("gamma", torch.where(identity, torch.ones_like(gamma), gamma)),
                             ("clamped", (clamped & ~identity).to(torch.float64)),
                             ("pr", pr_from_covariance(gram_after).cpu()), ("spread", spread),
                             ("spread_target", spread_target[idx])):
                    rec[f][idx] = v
        return rec

    # ----------------------------------------------------------------- records

    def _initial_record(self) -> dict[str, Tensor]:
        """The step-0 records: PR0 at the weight level now; at the token level NaN until
        the first training forward gives Σ."""
        n = len(self.names)
        if self.mode == "none":
            return {"pr": self.pr0.clone(), "pr_before": self.pr0.clone()}
        return {"target": self.pr0.clone(), "pr": self.pr0.clone(),
                "pr_before": self.pr0.clone(), "gamma": torch.ones(n, dtype=torch.float64),
                "clamped": torch.zeros(n, dtype=torch.float64)}

    def last(self) -> dict[str, float]:
        """The last step's records as a flat dict ``ctl_<field>_<unit>`` (unit ``l3`` or
        ``l3h1``; none for mode ``none``): target (PR aimed at), sched (the cap r(t)·base(t)
        before the current-PR bound; PR0 for hold), base (base(t)), dose (r(t)), pr
        (achieved, at the control's level), pr_before, gamma, clamped (0/1), spread (the key
        spread after the step), spread_target (the reference's, NaN when kept) and
        bound_share (share of the steps since :meth:`reset_window` where the cap bound;
        hold: where the reshape changed the spectrum). A value that is not defined (a
        spread target when the spread is kept, bound_share before any step, the token
        level's step-0 PRs before the first batch) is left out. Before any step: the step-0
        values (target = pr = PR0, gamma 1)."""
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

    # ----------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "mode": self.mode, "level": self.level,
                "scope": self.scope, "scale": self.scale, "arch": self.arch,
                "names": list(self.names), "pr0": [float(v) for v in self.pr0],
                "w0": None if self._w0 is None else [u.cpu().clone() for u in self._w0],
                "step": int(self.step_count),
                "last": {f: [float(x) for x in v] for f, v in self._last.items()},
                "bound": [float(v) for v in self._bound], "window": int(self._window),
                "reshapes": int(self.reshapes),
                "moments": self.moments.state_dict() if self.moments is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore PR0, the step counter, the window counters, the input moments and the
        last records.

        The per-step record (:attr:`trajectory`) is not part of the state: the callback
        keeps it in the run's key_pr.parquet and restores it from there."""
        if not state:
            raise QKGeomError("empty key-control state: the checkpoint was written without "
                              "key control")
        if state.get("version") != _STATE_VERSION:
            raise QKGeomError(f"saved key-control state version {state.get('version')!r}; "
                              f"this qkgeom reads {_STATE_VERSION}: train the run again")
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
