"""One seed -> independent generators for model init and data order.

Separate streams mean changing, say, the batch size does not change the init, and a
resumed run restores the data-order stream exactly from its saved state. The probe set and
the eval batches do not depend on the seed at all (they are fixed slices of held-out data),
so every run of one experiment is measured on the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_STREAMS = ("init", "data", "dropout")


@dataclass
class Generators:
    init: torch.Generator  # weights at step 0
    data: torch.Generator  # order of training windows (saved in checkpoints)
    dropout_seed: int  # seeds torch's global RNG, used only by dropout


def derive_seed(seed: int, stream: str) -> int:
    """A 63-bit seed for ``stream``, derived from ``seed`` with numpy's SeedSequence."""
    idx = _STREAMS.index(stream)
    state = np.random.SeedSequence([seed, idx]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


def make_generators(seed: int) -> Generators:
    return Generators(
        init=torch.Generator().manual_seed(derive_seed(seed, "init")),
        data=torch.Generator().manual_seed(derive_seed(seed, "data")),
        dropout_seed=derive_seed(seed, "dropout"),
    )
