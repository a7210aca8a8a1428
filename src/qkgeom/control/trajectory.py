"""The per-step key trajectory of a run, ``key_pr.parquet`` (columns :data:`COLUMNS`).

A file of its own because E3's arms follow the paired uncontrolled run at the *same step*
(its PR_K caps them and its key spread is matched), which the probes are too sparse for:
the reference run records ``pr``, ``pr_token`` and ``spread`` of every unit at step 0 and
after every update (docs/definitions.md#what-is-recorded), written atomically, with the
token-level PR on Σ without ε (``pr_token_raw``) and on the next batch's inputs
(``pr_token_oos``, NaN at the last step) beside them. Files written before those two
columns existed read with them NaN.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from torch import Tensor

from qkgeom.errors import QKGeomError
from qkgeom.io import write_parquet
from qkgeom.runs import KEY_PR, read_table

__all__ = ["COLUMNS", "FIELDS", "frame_to_trajectory", "read_key_pr", "reference_table",
           "write_key_pr"]

FIELDS = ("pr", "pr_token", "spread", "pr_token_raw", "pr_token_oos")
COLUMNS = ["step", "unit", *FIELDS]
_REQUIRED = ("step", "unit", "pr", "pr_token", "spread")  # the columns every version wrote
Trajectory = tuple[list[int], dict[str, list[Tensor]]]


def write_key_pr(run_dir: str | Path, steps: list[int], values: dict[str, list[Tensor]],
                 names: list[str]) -> None:
    """Write the whole trajectory (``values[f][i]`` = field ``f`` of every unit after step
    ``steps[i]``)."""
    n = len(names)
    cols = {f: (torch.stack(values[f]).reshape(-1).tolist() if steps else [])
            for f in FIELDS}
    frame = pd.DataFrame({
        "step": pd.Series([s for s in steps for _ in range(n)], dtype="int64"),
        "unit": pd.Series(names * len(steps), dtype="object"),
        **{f: pd.Series(cols[f], dtype="float64") for f in FIELDS},
    }, columns=COLUMNS)
    write_parquet(Path(run_dir) / KEY_PR, frame)


def read_key_pr(run_dir: str | Path, upto: int | None = None) -> pd.DataFrame | None:
    """The run's ``key_pr.parquet`` (rows with ``step <= upto``), None when absent; a torn
    or foreign file is a one-line QKGeomError."""
    frame = read_table(Path(run_dir) / KEY_PR, upto, columns=_REQUIRED)
    if frame is not None:
        for col in COLUMNS:
            if col not in frame.columns:
                frame[col] = float("nan")
    return frame


def frame_to_trajectory(frame: pd.DataFrame, names: list[str], where: str) -> Trajectory:
    """(steps, {field: per-step tensors in the order of ``names``}) from a key_pr table."""
    units = sorted(set(frame["unit"]))
    missing = [u for u in names if u not in units]
    if missing:
        raise QKGeomError(f"{where}: no key PR for unit(s) {', '.join(missing[:4])} (it has "
                          f"{', '.join(units[:6]) or 'none'}); was it trained with another "
                          "key_control.scope or model?")
    out: dict[str, list[Tensor]] = {}
    steps: list[int] = []
    for f in FIELDS:
        wide = frame.pivot_table(index="step", columns="unit", values=f, aggfunc="last",
                                 dropna=False)
        wide = wide.reindex(columns=names).sort_index()
        if f == "pr" and wide.isna().any().any():
            raise QKGeomError(f"{where}: some steps lack a unit's key PR")
        steps = [int(s) for s in wide.index]
        values = torch.tensor(wide.to_numpy(dtype=float), dtype=torch.float64)
        out[f] = list(values.unbind(0))
    return steps, out


def reference_table(run_dir: str | Path, names: list[str]) -> dict[str, Tensor]:
    """The reference run's trajectory, ``{field: (steps, units) float64}`` indexed by
    step; one line when it lacks a unit or a step (a cap needs every step)."""
    where = str(Path(run_dir) / KEY_PR)
    frame = read_key_pr(run_dir)
    if frame is None:
        raise QKGeomError(f"{where}: not found; the reference run must be trained with "
                          "key_control.record=true (the E3 none arm is)")
    steps, values = frame_to_trajectory(frame, names, where)
    if not steps or steps != list(range(len(steps))):
        gap = next((i for i, s in enumerate(steps) if s != i), len(steps))
        raise QKGeomError(f"{where}: the key PR trajectory is not whole (step {gap} is "
                          "missing); train the reference run to its end first")
    return {f: torch.stack(v) for f, v in values.items()}
