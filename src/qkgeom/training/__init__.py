"""Training: loop, schedule, checkpoints, callbacks (``qkgeom.train`` is the function)."""

from qkgeom.training.callbacks import Callback, TrainContext
from qkgeom.training.loop import RunResult, evaluate, load_run_config, train

__all__ = ["Callback", "TrainContext", "RunResult", "evaluate", "load_run_config", "train"]
