"""The one progress-bar layout of the CLI (rich): label, bar, n/total, fields, elapsed, ETA."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress


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
