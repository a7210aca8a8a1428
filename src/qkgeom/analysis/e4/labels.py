"""How E4 names a checkpoint: by its step when that is known (from its name, its
``trainer_state.json`` or the run that saved it), else (``step_source`` "order": a
pretrained model, folders without a step) by its name, never as "step 0".
"""

from __future__ import annotations

import re

import pandas as pd

__all__ = ["UNKNOWN_STEP", "checkpoint_label", "names_by_position"]

UNKNOWN_STEP = "order"  # the step_source of checkpoints whose step is only their position


def checkpoint_label(name: str, step: float, step_source: str) -> str:
    """``name (step N)`` when the step is known and the name does not already end in it
    (``step512``, ``ckpt_00000512``), else the name alone."""
    digits = re.search(r"(\d+)$", name)
    if step_source == UNKNOWN_STEP or (digits and int(digits.group(1)) == int(step)):
        return name
    return f"{name} (step {int(step)})"


def names_by_position(checkpoints: pd.DataFrame) -> dict[float, str] | None:
    """{position: name} when no checkpoint of ``checkpoints`` (columns ``checkpoint``,
    ``step``, ``step_source``) has a known step, so an axis or a table shows names; None
    when steps are known (a step axis)."""
    if checkpoints.empty or (checkpoints["step_source"] != UNKNOWN_STEP).any():
        return None
    return {float(r.step): str(r.checkpoint) for r in checkpoints.itertuples()}
