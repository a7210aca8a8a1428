"""Training: loop, schedule, checkpoints, callbacks."""

from qkgeom.train.callbacks import Callback, TrainContext
from qkgeom.train.loop import RunResult, evaluate, load_run_config, train

__all__ = ["Callback", "TrainContext", "RunResult", "evaluate", "load_run_config", "train"]
