"""``qkgeom watch``: the live view of a training run (:mod:`qkgeom.monitor.watch`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add ``watch`` to the ``qkgeom`` app."""

    @app.command("watch")
    def watch_cmd(
        run: Annotated[Path, typer.Argument(help="Run folder (a monitored or trained run).")],
        interval: Annotated[float, typer.Option(help="Seconds between polls.")] = 2.0,
        once: Annotated[bool, typer.Option("--once", help="Print the table once and exit.")] = False,
    ) -> None:
        """Live per-layer PR_Q, PR_K, contrast and attention entropy of the latest probe."""
        import math

        from qkgeom.errors import QKGeomError
        from qkgeom.monitor.watch import watch

        if not (math.isfinite(interval) and 0 < interval <= 86_400):
            raise QKGeomError(f"--interval must be a number of seconds in (0, 86400], got "
                              f"{interval}")
        try:
            watch(run, interval=interval, once=once)
        except KeyboardInterrupt:
            typer.echo("qkgeom watch: stopped")
