"""Learning-rate schedule: linear warm-up then cosine decay to ``min_lr_ratio * lr``."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, steps: int, min_lr_ratio: float) -> float:
    """LR for the update that takes the model from ``step`` to ``step + 1``."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    floor = lr * min_lr_ratio
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))
