"""``qkgeom train --report-to tensorboard|wandb``: the trainer's own probes and training log,
sent to the monitor's sinks (:mod:`qkgeom.monitor.sinks`).

A callback that logs only what the trainer measures anyway, so the run computes nothing
else. TensorBoard: event files in ``RUN/tensorboard/``; W&B: the active run, else a new one
in ``$WANDB_PROJECT`` (default ``qkgeom``), finished when training ends.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pandas as pd

from qkgeom.errors import QKGeomError
from qkgeom.monitor.sinks import TensorBoardSink, WandbSink, active_wandb_run, wandb_module
from qkgeom.runs import TENSORBOARD
from qkgeom.training import Callback, TrainContext

__all__ = ["REPORT_TARGETS", "ReportTo"]

REPORT_TARGETS = ("tensorboard", "wandb")


class ReportTo(Callback):
    """Log a qkgeom training run's probes and training log to TensorBoard and/or W&B."""

    def __init__(self, targets: list[str], run_dir: str | Path, run_id: str | None = None
                 ) -> None:
        unknown = [t for t in targets if t not in REPORT_TARGETS]
        if unknown:
            raise QKGeomError(f"unknown --report-to {unknown[0]!r}; choose from "
                              f"{', '.join(REPORT_TARGETS)}")
        self.targets, self.run_dir = list(dict.fromkeys(targets)), Path(run_dir)
        self.run_id = run_id or self.run_dir.name
        self.sinks: list[Any] = []
        self._wandb_owned: Any = None
        if "wandb" in self.targets and wandb_module() is None:  # fail before training
            raise QKGeomError("--report-to wandb needs the wandb package: pip install wandb")
        if "tensorboard" in self.targets:
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                raise QKGeomError("--report-to tensorboard needs the tensorboard package: "
                                  "pip install 'qkgeom[tensorboard]'") from None

    def on_train_start(self, ctx: TrainContext) -> None:
        if "tensorboard" in self.targets:
            self.sinks.append(TensorBoardSink(self.run_dir / TENSORBOARD))
        if "wandb" in self.targets:
            active = active_wandb_run()
            if active is None:
                module = wandb_module()
                run = module.init(project=os.environ.get("WANDB_PROJECT", "qkgeom"),
                                  name=self.run_id, config=ctx.config.to_dict())
                self._wandb_owned = run
                active = (module, run)
            module, run = active
            self.sinks.append(WandbSink(run, getattr(module, "Histogram", None)))

    def on_probe(self, ctx: TrainContext, metrics: pd.DataFrame) -> None:
        for sink in self.sinks:
            sink.log_frame(ctx.step, metrics)

    def on_log(self, ctx: TrainContext, row: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log_train(row)

    def on_train_end(self, ctx: TrainContext) -> None:
        for sink in self.sinks:
            sink.close()
        if self._wandb_owned is not None:
            self._wandb_owned.finish()
        self.sinks = []
