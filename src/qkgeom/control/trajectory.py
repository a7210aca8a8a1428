"""The per-step key-PR trajectory of a run, ``key_pr.parquet`` (columns ``step, unit, pr``).

Why a file of its own: a shrink or sham arm of E3 caps each unit's PR_K relative to the
*paired uncontrolled run at the same step* (``key_control.reference``), and the probes
(every ``probe_every`` steps) are too sparse for a per-step cap. So the reference run
records the weight PR_K of every unit at step 0 and after every update
(``key_control.record``), and the controlled run reads it back here.

The file name is :data:`qkgeom.runs.KEY_PR` (the run folder's one home for names); the
write is atomic (:func:`qkgeom.io.write_parquet`), so a reader never sees half a file.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from torch import Tensor

from qkgeom.errors import QKGeomError
from qkgeom.io import write_parquet
from qkgeom.runs import KEY_PR, read_table

__all__ = ["COLUMNS", "frame_to_trajectory", "read_key_pr", "reference_table", "write_key_pr"]

COLUMNS = ["step", "unit", "pr"]


def write_key_pr(run_dir: str | Path, steps: list[int], prs: list[Tensor],
                 names: list[str]) -> None:
    """Write the whole trajectory (``prs[i]`` = PR of every unit after step ``steps[i]``)."""
    n = len(names)
    values = torch.stack(prs).reshape(-1).tolist() if prs else []
    frame = pd.DataFrame({
        "step": pd.Series([s for s in steps for _ in range(n)], dtype="int64"),
        "unit": pd.Series(names * len(steps), dtype="object"),
        "pr": pd.Series(values, dtype="float64"),
    }, columns=COLUMNS)
    write_parquet(Path(run_dir) / KEY_PR, frame)


def read_key_pr(run_dir: str | Path, upto: int | None = None) -> pd.DataFrame | None:
    """The run's ``key_pr.parquet`` (rows with ``step <= upto``), None when absent; a torn
    or foreign file is a one-line QKGeomError."""
    return read_table(Path(run_dir) / KEY_PR, upto, columns=tuple(COLUMNS))


def frame_to_trajectory(frame: pd.DataFrame, names: list[str], where: str) -> tuple[list[int],
                                                                           list[Tensor]]:
    """(steps, per-step PR tensors in the order of ``names``) from a key_pr table."""
    units = sorted(set(frame["unit"]))
    missing = [u for u in names if u not in units]
    if missing:
        raise QKGeomError(f"{where}: no key PR for unit(s) {', '.join(missing[:4])} (it has "
                          f"{', '.join(units[:6]) or 'none'}); was it trained with another "
                          "key_control.scope or model?")
    wide = frame.pivot_table(index="step", columns="unit", values="pr", aggfunc="last")
    wide = wide[names].sort_index()
    if wide.isna().any().any():
        raise QKGeomError(f"{where}: some steps lack a unit's key PR")
    steps = [int(s) for s in wide.index]
    values = torch.tensor(wide.to_numpy(), dtype=torch.float64)
    return steps, list(values.unbind(0))


def reference_table(run_dir: str | Path, names: list[str]) -> Tensor:
    """The reference run's PR_K as a (last step + 1, units) float64 table indexed by step.

    Raises QKGeomError (one line) when the folder has no key_pr.parquet, lacks a unit, or
    skips a step: a cap relative to a reference needs its value at every step.
    """
    where = str(Path(run_dir) / KEY_PR)
    frame = read_key_pr(run_dir)
    if frame is None:
        raise QKGeomError(f"{where}: not found; the reference run must be trained with "
                          "key_control.record=true (the E3 none arm is)")
    steps, prs = frame_to_trajectory(frame, names, where)
    if not steps or steps != list(range(len(steps))):
        gap = next((i for i, s in enumerate(steps) if s != i), len(steps))
        raise QKGeomError(f"{where}: the key PR trajectory is not whole (step {gap} is "
                          "missing); train the reference run to its end first")
    return torch.stack(prs)
