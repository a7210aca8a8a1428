"""The key-spectrum control as a trainer callback (experiment E3).

Event order (:mod:`qkgeom.training.callbacks`): the control attaches in ``on_model_built``
(fresh step-0 weights, before the optimiser and any checkpoint: a parametrisation renames
``k_proj.weight`` to ``k_proj.parametrizations.weight.original``, which the checkpoint of a
resumed run then matches); a resumed run's saved state (step-0 PRs, step counter) replaces
what was measured at attach time in ``load_state_dict``, so targets never come from trained
weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qkgeom.config import KeyControlConfig
from qkgeom.control.keyspectrum import KeySpectrumControl
from qkgeom.errors import QKGeomError
from qkgeom.training.callbacks import Callback

if TYPE_CHECKING:
    import pandas as pd

    from qkgeom.training.callbacks import TrainContext

__all__ = ["KeyControlCallback"]


class KeyControlCallback(Callback):
    """Attaches :class:`KeySpectrumControl` to the trainer's model and steps it after every
    update. ``on_probe`` returns the last step's flat records (``ctl_target_l0``,
    ``ctl_pr_l0``, ...) so they land in ``metrics.parquet`` next to the probe metrics."""

    feature = "key_control"

    def __init__(self, settings: KeyControlConfig, *, layers: list[int] | None = None) -> None:
        settings.validate()
        self.settings, self.layers = settings, layers
        self.control: KeySpectrumControl | None = None
        self._restored = False

    def on_model_built(self, ctx: TrainContext) -> None:
        s = self.settings
        self.control = KeySpectrumControl.attach(
            ctx.model, s.mode, scope=s.scope, shrink_to=s.shrink_to, expand_to=s.expand_to,
            total_steps=ctx.config.steps, how=s.how, layers=self.layers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.control is None:
            raise QKGeomError("key control state given before the model was built")
        self.control.load_state_dict(state)
        self._restored = True

    def on_train_start(self, ctx: TrainContext) -> None:
        if ctx.step > 0 and not self._restored:
            raise QKGeomError(f"resuming at step {ctx.step} with key control "
                              f"{self.settings.mode!r}, but the checkpoint holds no key-control "
                              "state (was the run started without it?)")

    def on_step_end(self, ctx: TrainContext) -> None:
        self.control.step(ctx.step)

    def on_probe(self, ctx: TrainContext, metrics: pd.DataFrame) -> dict[str, float] | None:
        return self.control.last() or None

    def state_dict(self) -> dict[str, Any]:
        return self.control.state_dict() if self.control is not None else {}
