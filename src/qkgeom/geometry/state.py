"""Leave training exactly as it was: train/eval flags and every random generator.

Why: a probe must not change what training computes. A forward pass in eval mode draws
no random numbers in the models we support, but a user's model might (a custom layer, a
stochastic depth that ignores ``eval()``), and a probe that calls ``model.eval()`` /
``model.train()`` on the root would flip submodules the user froze in eval mode. So the
probe snapshots the per-module ``training`` flags and the torch (CPU and every
initialised CUDA device), Python ``random`` and NumPy global generators, and puts them
back whatever happens. With that, a monitored run and an unmonitored run are bit-identical
(tested on CPU).
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
