"""Trainer events: behaviour (key control, entropy control, your own) plugs in here instead
of growing flags. The trainer calls, in order:

- ``on_model_built(ctx)``: fresh weights, nothing loaded, no optimiser yet (the place for
  parametrisations, which rename the ``state_dict`` keys a checkpoint must match);
- ``load_state_dict(state)`` when resuming; ``on_train_start(ctx)``;
- per update ``on_step_end(ctx)``, per probe ``on_probe(ctx, metrics)``, per training-log
  row ``on_log(ctx, row)``; finally ``on_train_end(ctx)``.

A callback that serves a config section names it in ``feature``; the trainer refuses a
config enabling a feature no callback serves (:func:`qkgeom.launch.callbacks_for`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from qkgeom.config import TrainConfig
    from qkgeom.model import GPT


@dataclass
class TrainContext:
    """What a callback can see: the live model and optimiser, config and step."""

    config: TrainConfig
    model: GPT
    optimizer: torch.optim.Optimizer | None = None  # None until on_train_start
    step: int = 0  # optimiser updates done so far
    resumed: bool = False  # the run continues from a checkpoint
    extra: dict[str, Any] = field(default_factory=dict)  # callbacks' own state


class Callback:
    """Override any subset. ``state_dict``/``load_state_dict`` go into checkpoints."""

    feature: ClassVar[str | None] = None  # the config section this callback serves

    def on_model_built(self, ctx: TrainContext) -> None: ...

    def on_train_start(self, ctx: TrainContext) -> None: ...

    def on_step_end(self, ctx: TrainContext) -> None:
        """After every optimiser step (``ctx.step`` already incremented)."""

    def on_probe(self, ctx: TrainContext, metrics: pd.DataFrame) -> dict[str, float] | None:
        """After each probe; may return extra flat metrics (layer -1, head -1 rows)."""
        return None

    def on_log(self, ctx: TrainContext, row: dict[str, float]) -> None:
        """After each row of the training log (loss, val_loss, lr, ...; NaN = not
        measured at this step): for loggers such as TensorBoard."""

    def on_train_end(self, ctx: TrainContext) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
