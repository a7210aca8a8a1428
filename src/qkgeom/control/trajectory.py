"""The per-step key trajectory of a run, ``key_pr.parquet`` (columns :data:`COLUMNS`).

Why a file of its own: E3's controlled arms follow the *paired uncontrolled run at the same
step* (``key_control.reference``): a shrink or sham cap is relative to its PR_K, and under
the ``data`` scale rule every arm's key spread is matched to its spread. The probes (every
``probe_every`` steps) are too sparse for that, so the reference run records, for every
unit at step 0 and after every update (``key_control.record``):

- ``pr``: the weight-level PR_K, PR(σ²(W_K));
- ``pr_token``: the token-level PR_K on the running input covariance, PR(W_K Σ_ε W_Kᵀ)
  (:mod:`qkgeom.control.moments`), the spectrum the attention's keys have;
- ``spread``: the key spread tr(W_K Σ W_Kᵀ) = E‖k − E k‖².

The controlled run reads them back here. The file name is :data:`qkgeom.runs.KEY_PR` (the
run folder's one home for names); the write is atomic (:func:`qkgeom.io.write_parquet`),
so a reader never sees half a file.
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

FIELDS = ("pr", "pr_token", "spread")
COLUMNS = ["step", "unit", *FIELDS]
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
    or foreign file (or one written before ``pr_token`` and ``spread`` were recorded) is a
    one-line QKGeomError."""
    return read_table(Path(run_dir) / KEY_PR, upto, columns=tuple(COLUMNS))


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
    """The reference run's trajectory as ``{field: (last step + 1, units) float64}`` indexed
    by step.

    Raises QKGeomError (one line) when the folder has no key_pr.parquet, lacks a unit, or
    skips a step: a cap or a matched scale needs its value at every step.
    """
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
