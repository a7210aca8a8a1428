"""Training: the loop, its schedule, checkpoints and callback events.

``qkgeom.training.train`` trains with exactly the callbacks given; ``qkgeom.train`` (the
composition in :mod:`qkgeom.launch`) adds the ones a config asks for.
"""

from qkgeom.training.callbacks import Callback, TrainContext
from qkgeom.training.trainer import RunResult, Trainer, evaluate, resolve_device, train

__all__ = ["Callback", "RunResult", "TrainContext", "Trainer", "evaluate", "resolve_device",
           "train"]
