"""Callbacks the trainer tests plug in."""

from __future__ import annotations

from qkgeom.training import Callback, TrainContext


class StopAt(Callback):
    """Interrupts the run after update ``at``, as Ctrl-C would (the run stays resumable)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, ctx: TrainContext) -> None:
        if ctx.step == self.at:
            raise KeyboardInterrupt
