"""The key-spectrum control as a trainer callback (SPEC §4, E3).

Trainer order (``qkgeom.training.loop.train``): the model is built, a resumed checkpoint is
loaded into the model *and* into each callback's ``load_state_dict``, then
``on_train_start`` runs. So the callback keeps a state it is given before it is attached
and applies it when it attaches: a resumed run keeps the step-0 PRs and the step counter
of the original run, never re-measures them on trained weights.

``how="parametrize"`` changes the model's ``state_dict`` keys (``k_proj.weight`` becomes
``k_proj.parametrizations.weight.original``), so a trainer that resumes such a run must
call :meth:`KeyControlCallback.bind` on the fresh model *before* loading the checkpoint
(and before building the optimiser, for clarity -- the parameter object is kept either way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qkgeom.control.keyspectrum import KeySpectrumControl
from qkgeom.errors import QKGeomError
from qkgeom.training.callbacks import Callback

if TYPE_CHECKING:
    import pandas as pd
    from torch import nn

    from qkgeom.training.callbacks import TrainContext

__all__ = ["KeyControlCallback"]


class KeyControlCallback(Callback):
    """Attaches :class:`KeySpectrumControl` at train start and steps it after every update.

    ``on_probe`` returns the last step's flat records (``ctl_target_l0``, ``ctl_pr_l0``,
    ...) so they land in ``metrics.parquet`` next to the probe metrics.
    """

    def __init__(self, mode: str = "hold", *, scope: str = "layer", shrink_to: float = 0.5,
                 expand_to: float = 2.0, how: str = "post_step",
                 layers: list[int] | None = None) -> None:
        self.mode, self.scope, self.how = mode, scope, how
        self.shrink_to, self.expand_to, self.layers = shrink_to, expand_to, layers
        self.control: KeySpectrumControl | None = None
        self._pending: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> KeyControlCallback:
        """From a ``TrainConfig`` carrying ``key_control``, ``key_control_scope``,
        ``shrink_to``, ``expand_to``, ``key_control_how`` (missing fields: defaults, mode
        ``none``)."""
        return cls(getattr(cfg, "key_control", "none"),
                   scope=getattr(cfg, "key_control_scope", "layer"),
                   shrink_to=getattr(cfg, "shrink_to", 0.5),
                   expand_to=getattr(cfg, "expand_to", 2.0),
                   how=getattr(cfg, "key_control_how", "post_step"))

    def bind(self, model: nn.Module, total_steps: int, *, fresh: bool = True) -> KeySpectrumControl:
        """Attach to ``model`` now (idempotent). ``fresh``: the weights are the step-0
        weights, so PR0 is measured from them; otherwise it must come from a saved state."""
        if self.control is None:
            self.control = KeySpectrumControl.attach(
                model, self.mode, scope=self.scope, shrink_to=self.shrink_to,
                expand_to=self.expand_to, total_steps=total_steps, how=self.how,
                layers=self.layers, record_initial=fresh)
        if self._pending is not None and self.mode != "none":
            self.control.load_state_dict(self._pending)
            self._pending = None
        return self.control

    def on_train_start(self, ctx: TrainContext) -> None:
        if self.mode == "none":
            return
        resumed = ctx.step > 0
        if resumed and self._pending is None and (self.control is None or
                                                  self.control.step_count != ctx.step):
            raise QKGeomError(f"resuming at step {ctx.step} with key control "
                              f"{self.mode!r}, but the checkpoint holds no key-control state "
                              "(was the run started without it?)")
        self.bind(ctx.model, ctx.config.steps, fresh=not resumed)

    def on_step_end(self, ctx: TrainContext) -> None:
        if self.control is not None and self.mode != "none":
            self.control.step(ctx.step)

    def on_probe(self, ctx: TrainContext, metrics: pd.DataFrame) -> dict[str, float] | None:
        if self.control is None or self.mode == "none":
            return None
        return self.control.last() or None

    def state_dict(self) -> dict[str, Any]:
        if self.control is not None and self.mode != "none":
            return self.control.state_dict()
        return dict(self._pending or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.mode == "none" or not state:
            return
        if self.control is None:
            self._pending = dict(state)
        else:
            self.control.load_state_dict(state)
