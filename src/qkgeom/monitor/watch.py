"""``qkgeom watch RUN_DIR``: a live terminal view of a run's latest probe (rich).

Reads only ``metrics.parquet`` and ``status.json`` (no torch), so it works on any run folder
while it trains; it ends when the run is over, when nobody writes it any more (exit 1 with
one line), or on Ctrl-C (docs/monitor.md#where-the-results-go).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pandas as pd

from qkgeom.errors import QKGeomError
from qkgeom.runs import (
    FINAL_STATES,
    METRICS,
    STATUS,
    lock_is_held,
    read_alerts,
    read_metrics,
    read_status,
)

__all__ = ["Abandoned", "latest_layers", "render", "watch"]
_LEVELS = (("pr_q_token", "pr_k_token", "contrast_token"),
           ("pr_q_weight", "pr_k_weight", "contrast_weight"))


def latest_layers(metrics: pd.DataFrame) -> tuple[int, pd.DataFrame]:
    """``(step, table)``: per layer, PR_Q, PR_K, contrast, entropy at the last probe, and
    their change since the first probe (columns ``Δ…``)."""
    layer = metrics[(metrics["head"] == -1) & (metrics["layer"] >= 0)]
    if layer.empty:
        raise QKGeomError("no probe records yet")
    present = set(layer["metric"])
    level = next((lv for lv in _LEVELS if lv[0] in present or lv[1] in present), _LEVELS[0])
    names = dict(zip(level, ("PR_Q", "PR_K", "contrast"), strict=True))
    names["attn_entropy"] = "entropy"
    steps = sorted(int(s) for s in layer["step"].unique())

    def wide(step: int) -> pd.DataFrame:
        at = layer[(layer["step"] == step) & layer["metric"].isin(names)]
        return at.pivot_table(index="layer", columns="metric", values="value")

    now, first = wide(steps[-1]), wide(steps[0])
    table = pd.DataFrame(index=now.index)
    for metric, title in names.items():
        if metric in now:
            table[title] = now[metric]
    for metric, title in names.items():
        if metric in now and metric in first and len(steps) > 1:
            table[f"Δ{title}"] = now[metric] - first[metric]
    table.attrs["level"] = "token" if level is _LEVELS[0] else "weight"
    table.attrs["first_step"] = steps[0]
    return steps[-1], table


def _read(run: Path) -> tuple[pd.DataFrame | None, dict[str, Any]]:
    return read_metrics(run, missing_ok=True), read_status(run) or {}


def render(run: Path, metrics: pd.DataFrame | None, status: dict[str, Any]) -> Any:
    """The rich renderable: a per-layer table titled with the run's step and state."""
    from rich.console import Group

    from qkgeom.ui import plain, rich_table

    where = (f"step {status.get('step', '?')}/{status.get('steps', '?')}, "
             f"{status.get('state', '?')}")
    if metrics is None or metrics.empty:
        return plain(f"{run} — {where}: waiting for the first probe …")
    step, table = latest_layers(metrics)
    alerts = len(read_alerts(run))  # a bad alerts.json: one line naming it
    heading = plain(f"{run} — probe at step {step} ({where}; {table.attrs['level']} level; "
                    f"Δ = change since step {table.attrs['first_step']}"
                    + (f"; {alerts} alert(s), see alerts.json" if alerts else "") + ")")
    heading.stylize("bold")
    return Group(heading, rich_table(table))  # the title on its own line, unwrapped


def _abandoned(run: Path) -> str | None:
    """The line to end on when the run started but nobody writes it any more (it was
    interrupted or killed): its status is not final and no process holds its lock."""
    status = read_status(run) or {}
    if not status or status.get("state") in FINAL_STATES or lock_is_held(run):
        return None
    status = read_status(run) or {}  # a writer records its final state before it lets go
    state = status.get("state")
    if not status or state in FINAL_STATES:
        return None
    return (f"{run}: nobody is writing this run any more ({state} at step "
            f"{status.get('step', '?')} of {status.get('steps', '?')}); it stopped before "
            "finishing: resume it with `qkgeom train ... --resume` (or run its sweep again)")


def watch(run: str | Path, *, interval: float = 2.0, once: bool = False,
          console: Any = None) -> None:
    """Show the latest probe of ``run``; refresh every ``interval`` s until the run ends
    (``once``: print once and return)."""
    from rich.console import Console
    from rich.live import Live

    run = Path(run)
    if not run.is_dir():
        raise QKGeomError(f"{run}: no such run folder")
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped / logged: never truncate the numbers
            console = Console(width=max(console.width, 160))
    if once:
        metrics, status = _read(run)
        if metrics is None and not status:
            raise QKGeomError(f"{run}: not a run folder (no metrics.parquet or status.json)")
        console.print(render(run, metrics, status))
        return
    seen: tuple[float, float] | None = None
    with Live(render(run, *_read(run)), console=console, auto_refresh=False) as live:
        while True:
            stamp = tuple((run / n).stat().st_mtime if (run / n).exists() else 0.0
                          for n in (METRICS, STATUS))
            if stamp != seen:
                seen = stamp
                metrics, status = _read(run)
                live.update(render(run, metrics, status), refresh=True)
                if status.get("state") in FINAL_STATES:
                    return
            stopped = _abandoned(run)
            if stopped is not None:
                raise Abandoned(stopped)
            time.sleep(interval)


class Abandoned(QKGeomError):
    """The watched run stopped without finishing and nobody writes it (exit 1)."""

    exit_code = 1
