"""Leave training exactly as it was: train/eval flags and every random generator.

Why: a probe must not change what training computes, even for a model that draws random numbers
in eval mode or has submodules frozen in eval. With this, a monitored and an unmonitored run
are bit-identical on CPU (docs/monitor.md#training-is-unchanged).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

__all__ = ["frozen_training_state"]


@contextmanager
def frozen_training_state(model: nn.Module) -> Iterator[None]:
    """Run the block in eval mode without gradients, then restore modes and RNG states."""
    modes = [(m, m.training) for m in model.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = (torch.cuda.get_rng_state_all()
                if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    py_rng = random.getstate()
    np_rng = np.random.get_state()
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, was_training in modes:
            module.training = was_training
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)
