"""Trainer callbacks that drive a :class:`~qkgeom.monitor.GeometryMonitor`.

Built on first use, subclassing the trainer's own base class, so ``qkgeom.monitor``
imports neither transformers nor Lightning. Which events probe and where
``tensorboard="auto"`` writes: docs/monitor.md#where-the-results-go.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any, Protocol

from qkgeom.errors import QKGeomError

__all__ = ["hf_callback", "lightning_callback"]


class Monitor(Protocol):
    """What a callback drives: :class:`~qkgeom.monitor.GeometryMonitor`, named by its
    methods because importing it here would make an import cycle."""

    def start(self, step: int = 0, *, total_steps: int | None = None,
              tensorboard: Any = None) -> Any: ...

    def step(self, step: int, *, loss: float | None = None, lr: float | None = None) -> Any: ...

    def log_loss(self, step: int, loss: Any, lr: float | None = None) -> None: ...

    def close(self, state: str = "done", step: int | None = None) -> None: ...


def _loss(outputs: Any) -> Any:
    if isinstance(outputs, dict):
        return outputs.get("loss")
    return outputs if hasattr(outputs, "detach") else None


def _hf_trainer_writer(handler: Any) -> Any:
    """The ``SummaryWriter`` of the Trainer's own ``TensorBoardCallback`` among the
    callbacks of ``handler`` (a ``CallbackHandler``), or None."""
    for callback in getattr(handler, "callbacks", None) or []:
        writer = getattr(callback, "tb_writer", None)
        if writer is not None and hasattr(writer, "add_histogram"):
            return writer
    return None


def _calling_handler(depth: int = 4) -> Any:
    """The ``transformers`` ``CallbackHandler`` whose ``call_event`` called our callback
    (within ``depth`` frames), or None: HF hands callbacks no list of the others, and its
    TensorBoardCallback's writer is the Trainer's run."""
    from transformers.trainer_callback import CallbackHandler

    frame = inspect.currentframe()
    try:
        caller = frame.f_back if frame is not None else None
        for _ in range(depth):
            if caller is None:
                return None
            handler = caller.f_locals.get("self")
            if isinstance(handler, CallbackHandler):
                return handler
            caller = caller.f_back
        return None
    finally:
        del frame


def hf_callback(monitor: Monitor) -> Any:
    """A ``transformers.TrainerCallback`` for ``Trainer(callbacks=[...])``."""
    from transformers import TrainerCallback

    class GeometryMonitorCallback(TrainerCallback):
        def __init__(self) -> None:
            self.monitor = monitor

        def on_train_begin(self, args, state, control, **kwargs):
            writer = None
            if "tensorboard" in (args.report_to or []):
                writer = _hf_trainer_writer(_calling_handler()) or os.environ.get(
                    "TENSORBOARD_LOGGING_DIR") or os.path.join(args.output_dir, "runs",
                                                               "qkgeom")
            monitor.start(state.global_step, total_steps=state.max_steps or None,
                          tensorboard=writer)

        def on_step_end(self, args, state, control, **kwargs):
            monitor.step(state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                monitor.log_loss(state.global_step, logs["loss"], logs.get("learning_rate"))

        def on_train_end(self, args, state, control, **kwargs):
            monitor.close("done", state.global_step)

    return GeometryMonitorCallback()


def _lightning_base(package: str) -> type:
    names = ("lightning.pytorch", "pytorch_lightning") if package == "auto" else (package,)
    for name in names:
        try:
            return importlib.import_module(name).Callback
        except ImportError:
            continue
    raise QKGeomError("lightning_callback() needs `lightning` or `pytorch_lightning` "
                      "(pip install lightning)")


def lightning_callback(monitor: Monitor, package: str = "auto") -> Any:
    """A Lightning ``Callback`` for ``Trainer(callbacks=[...])``; ``package`` picks
    ``lightning.pytorch`` or ``pytorch_lightning`` (``auto``: the first installed)."""
    base = _lightning_base(package)

    class GeometryMonitorCallback(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.monitor = monitor

        def on_train_start(self, trainer, pl_module):
            writer = None
            for logger in getattr(trainer, "loggers", []) or []:
                experiment = getattr(logger, "experiment", None)
                if hasattr(experiment, "add_histogram"):
                    writer = experiment
                    break
            total = getattr(trainer, "max_steps", -1)
            if total is None or total < 0:
                total = getattr(trainer, "estimated_stepping_batches", None)
            total = int(total) if isinstance(total, (int, float)) and total < float("inf") else None
            monitor.start(trainer.global_step, total_steps=total, tensorboard=writer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            monitor.step(trainer.global_step, loss=_loss(outputs))

        def on_train_end(self, trainer, pl_module):
            monitor.close("done", trainer.global_step)

        def on_exception(self, trainer, pl_module, exception):
            monitor.close("failed", trainer.global_step)

    return GeometryMonitorCallback()
