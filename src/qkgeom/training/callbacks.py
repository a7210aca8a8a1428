"""Trainer events, so new behaviour (key control, monitors) plugs in instead of growing flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    optimizer: torch.optim.Optimizer
    step: int = 0  # optimiser updates done so far
    extra: dict[str, Any] = field(default_factory=dict)  # callbacks' own state


class Callback:
    """Override any subset. ``state_dict``/``load_state_dict`` go into checkpoints."""

    def on_train_start(self, ctx: TrainContext) -> None: ...

    def on_step_end(self, ctx: TrainContext) -> None:
        """After every optimiser step (``ctx.step`` already incremented)."""

    def on_probe(self, ctx: TrainContext, metrics: pd.DataFrame) -> dict[str, float] | None:
        """After each probe; may return extra flat metrics (layer -1, head -1 rows)."""
        return None

    def on_train_end(self, ctx: TrainContext) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
