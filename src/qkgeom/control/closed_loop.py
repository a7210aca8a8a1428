"""Closed loop (research-grade): steer attention entropy through the key spectrum.

A ``hold`` key control whose per-layer PR target moves at every probe toward a target
entropy, ``log PR*_l ← log PR*_l + clip(gain · (H*_l − H_l), ±max_step)``: entropy too low
raises the key PR, too high lowers it. Nothing guarantees the entropy follows (W_Q, the
logit scale and LayerNorm gains move attention too); the law, its use and what it did on the
demo: docs/monitor.md#closed-loop-research-grade.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from qkgeom.control import KeySpectrumControl
from qkgeom.errors import QKGeomError
from qkgeom.training.callbacks import Callback

if TYPE_CHECKING:
    import pandas as pd

    from qkgeom.training.callbacks import TrainContext

__all__ = ["EntropyControlCallback", "EntropyController", "SteeredKeyControl"]


class SteeredKeyControl(KeySpectrumControl):
    """``hold`` control whose per-layer target is ``setpoint`` (default PR0), set from
    outside (a thin subclass: :class:`KeySpectrumControl` schedules its own targets)."""

    setpoint: Tensor | None = None

    def hold_level(self) -> Tensor:
        return self.pr0 if self.setpoint is None else self.setpoint


class EntropyController:
    """Proportional controller of the key-PR setpoint toward a target attention entropy.

    ``target``: H* in nats, one for every controlled layer or one per layer; ``gain``: change
    of log PR* per nat of error per probe; ``max_step``: bound on |Δ log PR*| per probe;
    ``layers``: default all; ``scale``: what the reshape keeps (docs/definitions.md#scale-rule)."""

    def __init__(self, target: float | Sequence[float], *, gain: float = 1.0,
                 max_step: float = 0.25, layers: Sequence[int] | None = None,
                 scale: str = "data") -> None:
        targets = [float(target)] if isinstance(target, (int, float)) else [float(t) for t in target]
        if not targets or not all(math.isfinite(t) and t >= 0 for t in targets):
            raise QKGeomError(f"target entropy must be finite nats >= 0, got {target!r}")
        if not (gain > 0 and max_step > 0):
            raise QKGeomError("gain and max_step must be positive")
        self.targets, self.gain, self.max_step = targets, float(gain), float(max_step)
        self.layers = None if layers is None else [int(i) for i in layers]
        self.scale = scale
        self.control: SteeredKeyControl | None = None
        self._pending: dict[str, Any] | None = None
        self._last: dict[str, float] = {}

    # ------------------------------------------------------------------ wiring

    def attach(self, model: nn.Module) -> SteeredKeyControl:
        """Find W_K of every controlled layer and start holding it at its current PR."""
        if self.control is None:
            self.control = SteeredKeyControl.attach(model, "hold", level="weight",
                                                    scope="layer", scale=self.scale,
                                                    layers=self.layers)
            layers = [s.layer for s in self.control.sites]
            if len(self.targets) not in (1, len(layers)):
                raise QKGeomError(f"{len(self.targets)} target entropies for {len(layers)} "
                                  "controlled layers")
            self.control.setpoint = self.control.pr0.clone()
        if self._pending is not None:
            self.control.load_state_dict(self._pending["control"])
            self.control.setpoint = torch.tensor(self._pending["setpoint"], dtype=torch.float64)
            self._pending = None
        return self.control

    def _ctl(self) -> SteeredKeyControl:
        if self.control is None:
            raise QKGeomError("the entropy controller is not attached to a model yet")
        return self.control

    def target_for(self, layer: int) -> float:
        layers = [s.layer for s in self._ctl().sites]
        return self.targets[0] if len(self.targets) == 1 else self.targets[layers.index(layer)]

    # ------------------------------------------------------------------ acting

    def after_step(self, step: int) -> None:
        """Reshape W_K to the current setpoints (call after every optimiser step)."""
        self._ctl().step(step)

    def update(self, entropy: Mapping[int, float]) -> dict[str, float]:
        """One proportional update from a probe's layer-mean entropies ``{layer: nats}``;
        returns flat records (``ctl_entropy_target_l0``, ``ctl_entropy_l0``,
        ``ctl_setpoint_l0``, ...)."""
        ctl = self._ctl()
        setpoint = ctl.setpoint.clone()  # (N,) one unit per layer
        rec: dict[str, float] = {}
        for i, site in enumerate(ctl.sites):
            h = entropy.get(site.layer)
            if h is None or not math.isfinite(h):
                continue
            target = self.target_for(site.layer)
            step = max(-self.max_step, min(self.max_step, self.gain * (target - h)))
            upper = float(min(site.n_kv_head * site.head_dim, site.d_model))  # largest PR of W_K
            setpoint[i] = min(upper, max(1.0, float(setpoint[i]) * math.exp(step)))
            name = f"l{site.layer}"
            rec[f"ctl_entropy_target_{name}"] = target
            rec[f"ctl_entropy_{name}"] = float(h)
            rec[f"ctl_setpoint_{name}"] = float(setpoint[i])
        ctl.setpoint = setpoint
        self._last = rec
        return rec

    def records(self) -> dict[str, float]:
        """The last update's records and the key control's (``ctl_pr_l0`` = achieved PR)."""
        return {**self._last, **(self.control.last() if self.control is not None else {})}

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        if self.control is None:
            return dict(self._pending or {})
        return {"control": self.control.state_dict(),
                "setpoint": [float(v) for v in self.control.setpoint]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self._pending = dict(state)
            if self.control is not None:
                self.attach(self.control.model)


class EntropyControlCallback(Callback):
    """The closed loop inside ``qkgeom.train``, serving a config's ``entropy_control``: attach to
    the fresh model, reshape W_K after every step, update from the trainer's own probes (the
    ``ctl_*`` rows land in ``metrics.parquet``)."""

    feature = "entropy_control"

    def __init__(self, controller: EntropyController) -> None:
        self.controller = controller

    def on_model_built(self, ctx: TrainContext) -> None:
        self.controller.attach(ctx.model)

    def on_step_end(self, ctx: TrainContext) -> None:
        self.controller.after_step(ctx.step)

    def on_probe(self, ctx: TrainContext, metrics: pd.DataFrame) -> dict[str, float] | None:
        layer = metrics[(metrics["metric"] == "attn_entropy") & (metrics["head"] == -1)]
        self.controller.update({int(r.layer): float(r.value) for r in layer.itertuples()})
        return self.controller.records()

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state)
