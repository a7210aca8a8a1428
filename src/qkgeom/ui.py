"""Terminal output (rich): the one progress-bar layout, and per-layer tables.

Progress: label, bar, n/total, fields, elapsed, ETA. Tables: one row per layer, values to
3 decimals, changes (Δ columns) signed; never truncated when the output is not a terminal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table


def progress_bar(label: str, *fields: str, stderr: bool = False) -> Progress:
    """A started-on-demand ``rich`` Progress; ``fields`` are format strings such as
    ``"loss {task.fields[loss]}"``."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn(label), BarColumn(), MofNCompleteColumn(),
        *(TextColumn(f) for f in fields), TimeElapsedColumn(), TextColumn("eta"),
        TimeRemainingColumn(), console=Console(stderr=stderr),
    )


def rich_table(table: pd.DataFrame, title: str | None = None) -> Table:
    """``table`` (one row per layer, e.g. :func:`qkgeom.analysis.tables.layer_table`) as a
    ``rich`` Table: values to 3 decimals, changes (Δ columns) signed."""
    from rich.table import Table

    out = Table(title=title)
    out.add_column("layer", justify="right")
    for col in table.columns:
        out.add_column(col, justify="right")
    for layer, row in table.iterrows():
        out.add_row(str(layer), *(f"{v:+.3f}" if col.startswith("Δ") else f"{v:.3f}"
                                  for col, v in row.items()))
    return out


def console() -> Console:
    """A rich console on stdout; piped or logged, wide enough never to truncate numbers."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=max(out.width, 200))


def render_layers(table: pd.DataFrame, title: str) -> None:
    """Print a per-layer ``table`` (see :func:`rich_table`)."""
    console().print(rich_table(table, title))


def render_frame(frame: pd.DataFrame, title: str) -> None:
    """Print any small table (sweep status, claims) with rich; floats to 3 significant
    digits, never truncated when the output is not a terminal."""
    from rich.table import Table

    table = Table(title=title)
    for col in frame.columns:
        table.add_column(str(col))
    for row in frame.itertuples(index=False):
        table.add_row(*("" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
                        for v in row))
    console().print(table)
