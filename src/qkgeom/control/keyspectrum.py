"""Key-spectrum control during training (experiment E3; docs/definitions.md#key-spectrum-control).

:meth:`KeySpectrumControl.attach` finds the key projection W_K of every layer of a model
(any family :mod:`qkgeom.arch` supports: the project's GPT, Hugging Face GPT-2,
GPT-NeoX/Pythia, Llama-style and BERT-style models) and,
after each optimiser step (``how="post_step"``) or inside every forward pass
(``how="parametrize"``), replaces each controlled matrix -- a whole layer's W_K
(``scope="layer"``, d_k × d_model) or each head's slice (``scope="head"``, d_head ×
d_model) -- by ``U·diag(c·s^γ)·Vᵀ`` with PR(s′²) on a target and ‖W_K‖_F unchanged
(:mod:`qkgeom.control.spectrum`).

Targets (PR0 = the matrix's PR_K when the control is attached, i.e. at step 0):

* ``none``: nothing at all -- no SVD, no writes, training is bit-identical.
* ``hold``: PR0 for the whole run (both directions: the control pulls PR back up when
  training shrinks it and down when training expands it).
* ``shrink``: falls linearly from PR0 at step 0 to ``shrink_to``·PR0 at ``total_steps``
  and is never above the current PR: a matrix that training has already shrunk further is
  left alone (the control only ever shrinks).
* ``expand``: the mirror: rises linearly to ``expand_to``·PR0 (clamped to the matrix's
  largest PR, min(d_out, d_model)) and is never below the current PR.

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
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from qkgeom.arch import AttentionSite, adapter_for
from qkgeom.config import KeyControlConfig
from qkgeom.control.spectrum import default_rtol, fit_spectrum, spectral_reshape
from qkgeom.errors import QKGeomError
from qkgeom.geometry.spectra import participation_ratio, weight_pr

__all__ = [
    "HOWS",
    "MODES",
    "SCOPES",
    "KeySpectrumControl",
    "KeySpectrumParametrization",
    "target_schedule",
]

MODES = KeyControlConfig.MODES
SCOPES = KeyControlConfig.SCOPES
HOWS = KeyControlConfig.HOWS
_STATE_VERSION = 1
_RECORD_FIELDS = ("target", "sched", "pr", "pr_before", "gamma", "clamped")


def target_schedule(mode: str, pr0: Tensor, step: int, total_steps: int | None, *,
                    shrink_to: float = 0.5, expand_to: float = 2.0) -> Tensor:
    """The scheduled target PR at ``step`` (before the "never above/below the current PR"
    bound and the reachable-range clamp). Linear in ``step / total_steps``, constant after."""
    if mode == "hold" or mode == "none":
        return pr0.clone()
    frac = min(max(step / float(total_steps or 1), 0.0), 1.0)
    if mode == "shrink":
        return pr0 * (1.0 - (1.0 - shrink_to) * frac)
    if mode == "expand":
        return pr0 * (1.0 + (expand_to - 1.0) * frac)
    raise ValueError(f"unknown mode {mode!r}")


def _eigh_device(gram: Tensor) -> torch.device:
    """Where to run the batched eigh of (U, r, r) Gram matrices.

    On CUDA, cuSOLVER's batched Jacobi solver covers r <= 32 and larger r are solved one
    matrix at a time: measured on an H200, 36 heads of r = 64 took 27 ms there and 10 ms on
    the host, while r = 384 took 20 ms there and 58 ms on 16 host threads. So 32 < r <= 128
    goes to the CPU (a few hundred kB each way); everything else stays where it is.
    """
    r = gram.shape[-1]
    if gram.device.type == "cuda" and 32 < r <= 128:
        return torch.device("cpu")
    return gram.device


class KeySpectrumParametrization(nn.Module):
    """``forward(W)`` = W with its key (per layer or per head) reshaped to PR = ``target``.

    The ``torch.nn.utils.parametrize`` idiom: the stored parameter is the unconstrained
    ``original``; the model sees the reshaped weight, and gradients flow through the
    reshape (:func:`~qkgeom.control.spectrum.spectral_reshape`). ``target`` and
    ``identity`` (units passed through, e.g. a shrink target above the current PR) are
    non-persistent buffers that :class:`KeySpectrumControl` updates after each step.
    For fused q/k/v weights only the key slice changes.
    """

    def __init__(self, site: AttentionSite, scope: str, target: Tensor) -> None:
        super().__init__()
        self.site, self.scope = site, scope
        n_units = site.n_kv_head if scope == "head" else 1
        self.register_buffer("target", torch.as_tensor(target, dtype=torch.float64)
                             .reshape(n_units).clone(), persistent=False)
        self.register_buffer("identity", torch.zeros(n_units, dtype=torch.bool),
                             persistent=False)
        self.last_gamma: Tensor | None = None
        self.last_clamped: Tensor | None = None

    def forward(self, w: Tensor) -> Tensor:
        heads = self.site.k_heads(w)  # (H_kv, hd, d)
        k = heads if self.scope == "head" else heads.reshape(1, -1, self.site.d_model)  # (U, m, d)
        k_new, gamma, _, clamped = spectral_reshape(k, self.target, self.identity)
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
    """Holds / shrinks / expands the key spectrum of a model's layers (or heads).

    Build it with :meth:`attach`. Call :meth:`step` after every optimiser step; read
    :meth:`last` (flat dict of the last step's records) for logging. ``state_dict`` keeps
    PR0 and the step counter so a resumed run keeps the same targets.
    """

    def __init__(self, model: nn.Module, arch: str, sites: list[AttentionSite], *, mode: str,
                 scope: str, shrink_to: float, expand_to: float, total_steps: int | None,
                 how: str) -> None:
        self.model, self.arch, self.sites = model, arch, sites
        self.mode, self.scope, self.how = mode, scope, how
        self.shrink_to, self.expand_to, self.total_steps = shrink_to, expand_to, total_steps
        self.names: list[str] = []
        self._slices: list[slice] = []  # units of each site
        for site in sites:
            start = len(self.names)
            if scope == "head":
                self.names += [f"l{site.layer}h{h}" for h in range(site.n_kv_head)]
            else:
                self.names.append(f"l{site.layer}")
            self._slices.append(slice(start, len(self.names)))
        max_pr: list[float] = []  # largest PR each matrix can have: min(d_out, d_model)
        for site, sl in zip(sites, self._slices, strict=True):
            rows = site.head_dim if scope == "head" else site.n_kv_head * site.head_dim
            max_pr += [float(min(rows, site.d_model))] * (sl.stop - sl.start)
        self._max_pr = torch.tensor(max_pr, dtype=torch.float64)
        self.pr0 = torch.full((len(self.names),), math.nan, dtype=torch.float64)
        self.step_count = 0
        self._last: dict[str, Tensor] = {}
        self._params: list[KeySpectrumParametrization] = []

    # ----------------------------------------------------------------- construction

    @classmethod
    def attach(cls, model: nn.Module, mode: str = "hold", *, scope: str = "layer",
               shrink_to: float = 0.5, expand_to: float = 2.0, total_steps: int | None = None,
               how: str = "post_step", layers: Iterable[int] | None = None,
               record_initial: bool = True) -> KeySpectrumControl:
        """Validate, find the key weights, record PR0 and (for ``parametrize``) register.

        Args:
            model: the project's GPT or a supported HF causal LM (see module docstring).
            mode: one of :data:`MODES`; ``"none"`` touches nothing (not even the lookup).
            scope: ``"layer"`` (whole W_K) or ``"head"`` (each head's slice).
            shrink_to / expand_to: final target as a multiple of PR0 (``(0, 1]`` / ``>= 1``).
            total_steps: length of the schedule (needed by shrink and expand).
            how: ``"post_step"`` (project after each :meth:`step`) or ``"parametrize"``.
            layers: layer indices to control (default all).
            record_initial: take PR0 from the weights now (a fresh run at step 0). Pass
                False when the state comes from :meth:`load_state_dict` (resume).
        Raises:
            QKGeomError: bad arguments or an unsupported architecture.
        """
        if mode not in MODES:
            raise QKGeomError(f"unknown key-control mode {mode!r}; choose one of {', '.join(MODES)}")
        if scope not in SCOPES:
            raise QKGeomError(f"unknown key-control scope {scope!r}; choose one of {', '.join(SCOPES)}")
        if how not in HOWS:
            raise QKGeomError(f"unknown key-control method {how!r}; choose one of {', '.join(HOWS)}")
        if not (0.0 < shrink_to <= 1.0):
            raise QKGeomError(f"shrink_to must be in (0, 1], got {shrink_to}")
        if not (expand_to >= 1.0 and math.isfinite(expand_to)):
            raise QKGeomError(f"expand_to must be a finite number >= 1, got {expand_to}")
        if mode in ("shrink", "expand") and (total_steps is None or int(total_steps) <= 0):
            raise QKGeomError(f"key-control mode {mode!r} needs total_steps > 0 for its schedule")
        if mode == "none":
            return cls(model, "", [], mode=mode, scope=scope, shrink_to=shrink_to,
                       expand_to=expand_to, total_steps=total_steps, how=how)
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
        ctl = cls(model, arch, sites, mode=mode, scope=scope, shrink_to=shrink_to,
                  expand_to=expand_to, total_steps=total_steps, how=how)
        pr_now = ctl.current_pr()
        if record_initial:
            ctl.pr0 = pr_now.clone()
            ctl._last = ctl._initial_record()
        if how == "parametrize":
            for site, sl in zip(sites, ctl._slices, strict=True):
                p = KeySpectrumParametrization(site, scope, pr_now[sl])
                p.identity.fill_(True)  # the identity until the first step sets targets
                p.to(site.key_stored().device)
                parametrize.register_parametrization(site.k_module, "weight", p)
                ctl._params.append(p)
            if record_initial:
                ctl._set_param_targets()
        return ctl

    def remove(self) -> None:
        """Undo a ``parametrize`` attachment, keeping the current (reshaped) weights."""
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

    def target_now(self, step: int | None = None) -> Tensor:
        """Scheduled targets at ``step`` (default: the current step counter)."""
        step = self.step_count if step is None else step
        return target_schedule(self.mode, self.pr0, step, self.total_steps,
                               shrink_to=self.shrink_to, expand_to=self.expand_to)

    def _bounded(self, sched: Tensor, pr_before: Tensor, max_pr: Tensor) -> tuple[Tensor, Tensor]:
        """(target, identity): apply "never above / below the current PR"."""
        if self.mode == "shrink":
            identity = sched >= pr_before
        elif self.mode == "expand":
            sched = torch.minimum(sched, max_pr)
            identity = sched <= pr_before
        else:
            identity = torch.zeros_like(sched, dtype=torch.bool)
        return torch.where(identity, pr_before, sched), identity

    # ----------------------------------------------------------------- stepping

    def step(self, step: int | None = None) -> dict[str, float]:
        """Apply the control after an optimiser step; returns :meth:`last`.

        ``step`` is the number of optimiser updates done (default: one more than last
        time); it sets where on the schedule the targets are.
        """
        if self.mode == "none":
            return {}
        self.step_count = self.step_count + 1 if step is None else int(step)
        if bool(torch.isnan(self.pr0).any()):
            raise QKGeomError("key control has no step-0 PRs: attach with record_initial=True "
                              "or load_state_dict() from a checkpoint before stepping")
        if self.how == "parametrize":
            self._last = self._set_param_targets()
        else:
            self._last = self._project()
        return self.last()

    def _groups(self) -> list[list[int]]:
        """Site indices grouped by unit shape, dtype and device: one batched SVD each."""
        groups: dict[tuple, list[int]] = {}
        for j, site in enumerate(self.sites):
            w = site.key_stored()
            rows = site.head_dim if self.scope == "head" else site.n_kv_head * site.head_dim
            groups.setdefault((rows, site.d_model, w.dtype, w.device), []).append(j)
        return list(groups.values())

    @torch.no_grad()
    def _project(self) -> dict[str, Tensor]:
        """post_step: per group of equally shaped matrices, one batched eigendecomposition
        of the float64 Gram matrices on the weights' device, the fit (γ) on the CPU, the
        reshape ``W′ = U·diag(s′/s)·Uᵀ·W`` (= U·diag(s′)·Vᵀ), in-place writes of the changed
        units, and the achieved PR re-measured on the stored weights.

        Why the Gram route and not ``torch.linalg.svd``: same U and s (s² = eigenvalues of
        W·Wᵀ), but 2-10x faster on CPU and GPU for these shapes (a head's 64 x 384 slice
        needs a 64 x 64 eigh instead of an SVD), and the bisection runs on the CPU, where
        its many tiny steps cost less than GPU launches. Singular values below
        ``max(default_rtol, √(8·r·eps64))·s_max`` are treated as zero (the Gram's
        eigenvalues resolve s only down to about √eps·s_max). A test checks the result
        equals :func:`~qkgeom.control.spectrum.apply_target` (the SVD route).
        """
        sched_all = self.target_now()
        rec = {f: torch.zeros(len(self.names), dtype=torch.float64) for f in _RECORD_FIELDS}
        for group in self._groups():
            sites = [self.sites[j] for j in group]
            idx = torch.cat([torch.arange(self._slices[j].start, self._slices[j].stop)
                             for j in group])  # unit indices, in stacking order
            a = torch.cat([self._units(site, site.key_stored()) for site in sites])  # (U, m, d)
            wide = a.shape[-2] <= a.shape[-1]
            gram = a @ a.mT if wide else a.mT @ a  # (U, r, r), r = min(m, d)
            lam, vec = torch.linalg.eigh(gram.to(_eigh_device(gram)))  # ascending
            lam, vec = lam.flip(-1).clamp_min(0), vec.flip(-1).to(a.device)  # descending
            lam_cpu = lam.cpu()
            s = lam_cpu.sqrt()  # (U, r) singular values
            r = s.shape[-1]
            pr_before = participation_ratio(lam_cpu)  # (U,) PR of s²
            sched = sched_all[idx]
            target, identity = self._bounded(sched, pr_before, self._max_pr[idx])
            rtol = max(default_rtol(r, sites[0].key_stored().dtype),
                       math.sqrt(8 * r * torch.finfo(torch.float64).eps))
            fit = fit_spectrum(s, target, rtol=rtol)
            changed = ~identity & ~fit.flat & (fit.gamma != 1)  # (U,)
            if bool(changed.any()):
                pos = s > 0
                ratio = torch.where(pos, fit.s / torch.where(pos, s, torch.ones_like(s)),
                                    torch.zeros_like(s)).to(a.device)  # s′/s, 0 for zeros
                mix = (vec * ratio.unsqueeze(-2)) @ vec.mT  # (U, r, r) = U·diag(s′/s)·Uᵀ
                new = mix @ a if wide else a @ mix  # (U, m, d)
                offset = 0
                for site in sites:
                    n_units = site.n_kv_head if self.scope == "head" else 1
                    view = site.k_heads(site.key_stored())  # (H_kv, hd, d) view, in place
                    mine = changed[offset:offset + n_units]
                    if self.scope == "head":
                        for h in torch.nonzero(mine).flatten().tolist():
                            view[h].copy_(new[offset + h])
                    elif bool(mine[0]):
                        view.copy_(new[offset].view(view.shape))
                    offset += n_units
            after = torch.cat([self._units(site, site.key_stored()) for site in sites])
            rec["target"][idx] = torch.where(identity, pr_before, fit.target)
            rec["sched"][idx] = sched
            rec["pr_before"][idx] = pr_before
            rec["gamma"][idx] = torch.where(identity, torch.ones_like(fit.gamma), fit.gamma)
            rec["clamped"][idx] = (fit.clamped & ~identity).to(torch.float64)
            rec["pr"][idx] = weight_pr(after).cpu()  # achieved, as stored
        return rec

    def _set_param_targets(self) -> dict[str, Tensor]:
        """parametrize: set each parametrisation's targets for the coming forward passes."""
        sched_all = self.target_now()
        rec = {f: torch.zeros(len(self.names), dtype=torch.float64) for f in _RECORD_FIELDS}
        with torch.no_grad():
            for site, sl, p in zip(self.sites, self._slices, self._params, strict=True):
                pr_before = weight_pr(self._units(site, site.key_stored())).cpu()  # unconstrained
                sched = sched_all[sl]
                target, identity = self._bounded(sched, pr_before, self._max_pr[sl])
                p.target.copy_(target)
                p.identity.copy_(identity)
                effective = site.key_effective()  # runs the parametrisation, new targets
                rec["target"][sl] = target
                rec["sched"][sl] = sched
                rec["pr_before"][sl] = pr_before
                rec["gamma"][sl] = p.last_gamma.cpu()
                rec["clamped"][sl] = (p.last_clamped.cpu() & ~identity).to(torch.float64)
                rec["pr"][sl] = weight_pr(self._units(site, effective)).cpu()
        return rec

    # ----------------------------------------------------------------- records

    def _initial_record(self) -> dict[str, Tensor]:
        n = len(self.names)
        return {"target": self.pr0.clone(), "sched": self.pr0.clone(), "pr": self.pr0.clone(),
                "pr_before": self.pr0.clone(), "gamma": torch.ones(n, dtype=torch.float64),
                "clamped": torch.zeros(n, dtype=torch.float64)}

    def last(self) -> dict[str, float]:
        """The last step's records as a flat dict: ``ctl_<field>_<unit>`` for field in
        target (PR aimed at), sched (scheduled target before the current-PR bound), pr
        (achieved, measured on the weights), pr_before, gamma, clamped (0/1); unit ``l3`` or
        ``l3h1``. Before any step: the step-0 values (target = pr = PR0, gamma 1)."""
        return {f"ctl_{f}_{name}": float(self._last[f][i])
                for f in _RECORD_FIELDS if f in self._last for i, name in enumerate(self.names)}

    def targets(self) -> dict[str, float]:
        """``{"ctl_target_<unit>": PR aimed at in the last step}``."""
        return {k: v for k, v in self.last().items() if k.startswith("ctl_target_")}

    # ----------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "mode": self.mode, "scope": self.scope,
                "arch": self.arch, "names": list(self.names),
                "pr0": [float(v) for v in self.pr0], "step": int(self.step_count),
                "last": {f: [float(x) for x in v] for f, v in self._last.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore PR0 and the step counter (and the last records) of a saved control."""
        if not state:
            raise QKGeomError("empty key-control state: the checkpoint was written without "
                              "key control")
        for key in ("mode", "scope", "names"):
            if state.get(key) != (self.names if key == "names" else getattr(self, key)):
                raise QKGeomError(f"saved key-control {key} {state.get(key)!r} does not match "
                                  f"this run's {getattr(self, key)!r}")
        pr0 = torch.tensor(state["pr0"], dtype=torch.float64)
        if self.names and not bool(torch.isfinite(pr0).all()):
            raise QKGeomError("saved key-control state has no valid step-0 PRs")
        self.pr0 = pr0
        self.step_count = int(state["step"])
        self._last = {f: torch.tensor(v, dtype=torch.float64)
                      for f, v in state.get("last", {}).items()}
        if self.how == "parametrize" and self.names:
            self._set_param_targets()
            # keep the saved records: they describe the step the checkpoint was taken at
            self._last = {f: torch.tensor(v, dtype=torch.float64)
                          for f, v in state.get("last", {}).items()}
