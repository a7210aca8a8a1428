"""``qkgeom compare`` (two runs' per-layer metrics side by side) and ``qkgeom runs`` (the run
folders under a folder, with state, steps and losses): :mod:`qkgeom.runs.overview` printed
through the tables ``show`` and ``sweep status`` use."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from qkgeom.cli.output import (
    check_format,
    format_option,
    layer_legend,
    records,
    unset,
    write_csv,
    write_json,
)
from qkgeom.errors import QKGeomError

CompareFormat = format_option("one row per layer: each metric of A, of B and B − A "
                              "(json: with both runs' paths and steps)")
RunsFormat = format_option("one row per run folder: run, state, step, steps, loss, "
                           "val_loss, wall_s, updated")


def _metric_names(given: list[str] | None) -> list[str] | None:
    """``--metric`` values, repeatable or comma-separated; None when none was given."""
    names = [m.strip() for item in given or [] for m in item.split(",") if m.strip()]
    return names or None


def compare_cmd(
    run_a: Annotated[Path, typer.Argument(help="Run folder A (trained, swept or monitored).")],
    run_b: Annotated[Path, typer.Argument(help="Run folder B, compared with A (B − A).")],
    metric: unset(list[str], "A per-layer metric to compare, repeatable or comma-separated "
                             "(default: pr_q_token, pr_k_token, contrast_token, pr_qk_token, "
                             "attn_entropy; names: docs/definitions.md#metrics).",
                  "--metric", "-m") = None,
    step: unset(int, "Probe step, in both runs (default: each run's last probe).") = None,
    fmt: CompareFormat = "table",
) -> None:
    """Two runs' per-layer metrics side by side at their last (or one) probe, with B − A."""
    import pandas as pd

    from qkgeom.runs import compare_runs

    check_format(fmt)
    if step is not None and step < 0:
        raise QKGeomError(f"--step must be >= 0, got {step}")
    found = compare_runs(run_a, run_b, _metric_names(metric), step)
    wide = found.table.pivot(index="layer", columns="metric", values=["a", "b", "diff"])
    if fmt != "table":
        table = pd.DataFrame({f"{m}_{side}": wide[(side, m)] for m in found.metrics
                              for side in ("a", "b", "diff")}).reset_index()
        if fmt == "csv":
            write_csv(table)
            return
        write_json({"a": {"run": str(run_a), "step": found.step_a},
                    "b": {"run": str(run_b), "step": found.step_b},
                    "metrics": found.metrics, "layers": records(table)})
        return
    from qkgeom.analysis.tables import COLUMNS
    from qkgeom.ui import printable, render_layers

    titles = dict(COLUMNS)
    shown = pd.DataFrame({f"{pre}{titles.get(m, m)}{post}": wide[(side, m)]
                          for m in found.metrics
                          for side, pre, post in (("a", "", " A"), ("b", "", " B"),
                                                  ("diff", "Δ", ""))})
    at = (f"step {found.step_a}" if found.step_a == found.step_b
          else f"steps {found.step_a} (A) and {found.step_b} (B)")
    # escaped before the legend is laid out in lines (an escape is wider than its character)
    legend = [f"A = {printable(run_a)} at step {found.step_a}",
              f"B = {printable(run_b)} at step {found.step_b}",
              "ΔX = B − A", *(e for e in layer_legend([str(c) for c in shown.columns])
                               if not e.startswith("ΔX@N"))]
    render_layers(shown, f"{run_a} vs {run_b} — per-layer Q/K geometry at {at}", legend)


def _ago(updated: float, now: float) -> str:
    """``12 s ago``, ``3 min ago``, ``2 h ago``; ``-`` for no time."""
    if not math.isfinite(updated):
        return "-"
    seconds = max(now - updated, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    return f"{seconds / 60:.0f} min ago" if seconds < 7200 else f"{seconds / 3600:.0f} h ago"


def runs_cmd(
    folder: Annotated[Path, typer.Argument(help="A folder holding run folders (runs/, a sweep "
                                                "folder, ...), searched recursively.")],
    fmt: RunsFormat = "table",
) -> None:
    """The run folders under FOLDER: state, step reached, last loss and val loss, wall time."""
    from qkgeom.runs import list_runs
    from qkgeom.ui import clock, render_frame

    check_format(fmt)
    found = list_runs(folder)
    if fmt == "json":
        write_json({"folder": str(folder), "runs": records(found)})
        return
    if fmt == "csv":
        write_csv(found)
        return
    if found.empty:
        typer.echo(f"{folder}: no run folder under it")
        return
    now = time.time()
    shown: Any = found.assign(
        loss=found["loss"].map(_number), val_loss=found["val_loss"].map(_number),
        wall=found["wall_s"].map(lambda s: clock(s) if math.isfinite(s) else "-"),
        updated=found["updated"].map(lambda t: _ago(t, now)))
    shown = shown[["run", "state", "step", "steps", "loss", "val_loss", "wall", "updated"]]
    counts = [f"{n} {state}" for state, n in found["state"].value_counts().items()]
    render_frame(shown.rename(columns={"val_loss": "val loss", "updated": "status written"}),
                 f"{folder} — runs",
                 [*counts, "loss, val loss: the last logged; wall: h:mm:ss of training; a "
                           "live run writes its status at least every 30 s"])


def _number(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else "-"


def register(app: typer.Typer) -> None:
    """Add ``compare`` and ``runs`` to the ``qkgeom`` app."""
    app.command("compare")(compare_cmd)
    app.command("runs")(runs_cmd)
