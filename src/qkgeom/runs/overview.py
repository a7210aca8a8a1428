"""Runs at a glance: the run folders under a folder with their state and losses
(``qkgeom runs``), a run's last losses (``qkgeom show``), and two runs' per-layer metrics
side by side (``qkgeom compare``). Readers of the run folder only, like ``show``: they work
on finished, live and monitored runs alike.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qkgeom.errors import QKGeomError
from qkgeom.runs.folder import (
    CHECKPOINTS,
    REPORT,
    TENSORBOARD,
    is_run_folder,
    read_log,
    read_metrics,
    status_of,
)

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["COMPARED", "RUN_COLUMNS", "Comparison", "compare_runs", "find_runs", "last_losses",
           "list_runs"]

#: What ``qkgeom compare`` shows when no ``--metric`` is given (those both runs recorded).
COMPARED = ("pr_q_token", "pr_k_token", "contrast_token", "pr_qk_token", "attn_entropy")
#: The columns of :func:`list_runs`.
RUN_COLUMNS = ["run", "state", "step", "steps", "loss", "val_loss", "wall_s", "updated"]
# Folders inside a run folder that hold no run of their own (not searched).
_INSIDE_A_RUN = frozenset({CHECKPOINTS, REPORT, TENSORBOARD, "metrics.parts",
                           "train_log.parts"})


def last_losses(run: str | Path) -> dict[str, float | int | None]:
    """The run's last finite training loss and validation loss, each with its step
    (``loss``, ``loss_step``, ``val_loss``, ``val_loss_step``; None where the run logged
    none: a monitored run given no loss)."""
    log = read_log(run)
    out: dict[str, float | int | None] = {"loss": None, "loss_step": None, "val_loss": None,
                                          "val_loss_step": None}
    if log is None:
        return out
    for column in ("loss", "val_loss"):
        rows = log[log[column].map(lambda v: isinstance(v, float) and math.isfinite(v))]
        if len(rows):
            out[column] = float(rows[column].iloc[-1])
            out[f"{column}_step"] = int(rows["step"].iloc[-1])
    return out


def find_runs(root: str | Path) -> list[Path]:
    """Every run folder at or under ``root`` (a sweep's ``runs/<id>/`` too), sorted; links
    are not followed and a run folder's own subfolders are not searched. A missing
    ``root`` is a one-line QKGeomError."""
    root = Path(root)
    if not root.is_dir():
        raise QKGeomError(f"{root}: no such folder")
    found = []
    for folder, subdirs, _ in os.walk(root, followlinks=False):
        here = Path(folder)
        if is_run_folder(here):
            found.append(here)
            subdirs[:] = []
        else:
            subdirs[:] = sorted(d for d in subdirs if d not in _INSIDE_A_RUN
                                and not (here / d).is_symlink())
    return sorted(found)


def list_runs(root: str | Path) -> pd.DataFrame:
    """One row per run folder under ``root`` (:func:`find_runs`): ``run`` (its path under
    ``root``), ``state`` (``status.json``'s; ``unreadable`` for a status that is not
    qkgeom's), ``step`` reached of ``steps``, the last ``loss`` and ``val_loss``, ``wall_s``
    and ``updated`` (the status's Unix time: a live run's heartbeat moves it at least every
    30 s, docs/training.md)."""
    import pandas as pd

    root = Path(root)
    rows = []
    for run in find_runs(root):
        status, problem = status_of(run)
        status = status or {}
        rows.append({"run": str(run.relative_to(root)) if run != root else ".",
                     "state": "unreadable" if problem else status.get("state", "pending"),
                     "step": int(status.get("step", 0)), "steps": int(status.get("steps", 0)),
                     **{k: v for k, v in last_losses(run).items() if not k.endswith("_step")},
                     "wall_s": status.get("wall_s"), "updated": status.get("updated")})
    return pd.DataFrame(rows, columns=RUN_COLUMNS).astype({"loss": float, "val_loss": float,
                                                           "wall_s": float, "updated": float})


@dataclass
class Comparison:
    """Two runs' per-layer values (head −1) at one probe each: ``table`` has one row per
    (``layer``, ``metric``) with ``a``, ``b`` and ``diff`` = b − a (NaN where a run has no
    such layer)."""

    run_a: Path
    run_b: Path
    step_a: int
    step_b: int
    metrics: list[str]
    table: pd.DataFrame


def _at(run: Path, metrics: pd.DataFrame, step: int | None) -> tuple[int, pd.DataFrame]:
    """The layer rows (head −1) of ``run`` at ``step`` (default: its last probe)."""
    rows = metrics[(metrics["head"] == -1) & (metrics["layer"] >= 0)]
    if "block" in rows:  # an analysis folder's token blocks: the table is of all tokens
        rows = rows[rows["block"] < 0]
    steps = sorted(int(s) for s in rows["step"].unique())
    if not steps:
        raise QKGeomError(f"{run}: no per-layer probe recorded yet")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        shown = ", ".join(map(str, steps[:12])) + (" ..." if len(steps) > 12 else "")
        raise QKGeomError(f"{run}: no probe at step {step}; probed steps: {shown}")
    return step, rows[rows["step"] == step]


def compare_runs(run_a: str | Path, run_b: str | Path, metrics: list[str] | None = None,
                 step: int | None = None) -> Comparison:
    """Runs ``run_a`` and ``run_b`` side by side: the per-layer ``metrics`` (default
    :data:`COMPARED`, those both recorded) at ``step`` in both (default: each run's last
    probe), with b − a. A metric either run did not record, or a step either did not
    probe, is a one-line QKGeomError naming the run."""
    import pandas as pd

    run_a, run_b = Path(run_a), Path(run_b)
    (step_a, at_a), (step_b, at_b) = (_at(r, read_metrics(r), step) for r in (run_a, run_b))
    have = [set(at_a["metric"].astype(str)), set(at_b["metric"].astype(str))]
    if metrics:
        for name in metrics:
            for run, names in zip((run_a, run_b), have, strict=True):
                if name not in names:
                    close = difflib.get_close_matches(name, sorted(names), n=2, cutoff=0.6)
                    hint = ("; did you mean " + " or ".join(map(repr, close)) + "?" if close
                            else f"; recorded: {', '.join(sorted(names))}")
                    raise QKGeomError(f"{run}: metric {name!r} is not recorded per layer{hint}")
        chosen = list(dict.fromkeys(metrics))
    else:
        chosen = [m for m in COMPARED if m in have[0] and m in have[1]]
        if not chosen:
            raise QKGeomError(f"{run_a} and {run_b} record none of {', '.join(COMPARED)} in "
                              "common; name the metrics with --metric")

    def values(at: pd.DataFrame) -> pd.Series:
        rows = at[at["metric"].astype(str).isin(chosen)]
        return rows.assign(metric=rows["metric"].astype(str)).groupby(
            ["layer", "metric"])["value"].last()

    table = pd.concat({"a": values(at_a), "b": values(at_b)}, axis=1).reset_index()
    table["diff"] = table["b"] - table["a"]
    order = {m: i for i, m in enumerate(chosen)}
    table = table.sort_values(["layer", "metric"], key=lambda c: c.map(order) if c.name ==
                              "metric" else c, kind="stable").reset_index(drop=True)
    table["layer"] = table["layer"].astype(int)
    return Comparison(run_a, run_b, step_a, step_b, chosen, table)

