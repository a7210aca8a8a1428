"""What the CLI prints: ``--format table|json|csv``, the per-layer table's legend and its
machine-readable column names, and where the informational lines go.

``table`` (default) is for people: rich tables that fit the terminal (:mod:`qkgeom.ui`)
with a legend line. ``json`` and ``csv`` are for programs: stdout then holds only the
document (one JSON object; one CSV table), every other line goes to stderr, and columns
carry the metric names of docs/definitions.md instead of the display titles.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from qkgeom.errors import QKGeomError

if TYPE_CHECKING:
    import pandas as pd

FORMATS = ("table", "json", "csv")


def format_option(data: str) -> Any:
    """The ``--format`` option of a command whose machine form (json, csv) prints
    ``data`` (each command says what it prints)."""
    return Annotated[str, typer.Option(
        "--format", help=f"table (for people) | json | csv (for programs: stdout holds "
                         f"only {data}).")]


def unset(kind: Any, help: str, *names: str) -> Any:
    """An option that is None unless given (the command then decides); ``help`` says what
    None means, so no default is shown."""
    return Annotated[kind | None, typer.Option(*names, help=help, show_default=False)]


#: ``--format`` of the per-layer tables (``show``).
Format = format_option("the per-layer table, with metric names as keys")
#: ``--format`` of ``report`` and ``reproduce``'s claims.
ClaimsFormat = format_option("the claims table, one row per claim, level and origin "
                             "(json: with the report's paths)")
#: ``--format`` of ``sweep status``.
StatusFormat = format_option("the state of each run, one row per run")
#: ``--format`` of ``analyze``.
AnalysisFormat = format_option("the last checkpoint's per-layer table, with metric names "
                               "as keys (json: also the contrast trends)")

#: What the per-layer table's column names mean (docs/definitions.md#metrics).
_LEGEND = (
    (" w", "w = weight level (from W_Q, W_K)"),
    ("tok", "tok = token level (the probe set's q, k)"),
    ("contrast", "contrast = PR_Q − PR_K"),
    ("pr_qk", "pr_qk = PR of the interaction spectrum (W_Q W_Kᵀ, or QKᵀ per sequence)"),
    ("entropy", "entropy = mean attention entropy in nats (norm: ÷ log of the keys "
                "attended)"),
    ("Δ", "ΔX@N = change since step N"),
)


def check_format(fmt: str) -> str:
    """``fmt`` if it is a known format, else a one-line QKGeomError."""
    if fmt not in FORMATS:
        raise QKGeomError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def info(message: str, fmt: str = "table", quiet: bool = False) -> None:
    """An informational line: stdout for people, stderr when stdout holds data; none when
    ``quiet``."""
    if not quiet:
        typer.echo(message, err=fmt != "table")


def layer_legend(columns: list[str]) -> list[str]:
    """The legend entries for the abbreviations among ``columns`` (PR = participation
    ratio, the effective number of dimensions), and where they are defined."""
    parts = ["PR = participation ratio (effective dimension)"]
    parts += [text for key, text in _LEGEND if any(key in c for c in columns)]
    return [*parts, "definitions: docs/definitions.md#metrics"]


def machine_columns(table: pd.DataFrame) -> pd.DataFrame:
    """The per-layer table with metric names as columns (``pr_q_weight``, ...,
    ``delta_pr_q_token_since_0``) and ``layer`` as a column."""
    from qkgeom.analysis.tables import COLUMNS

    names = {title: metric for metric, title in COLUMNS}
    renamed = {}
    for col in table.columns:
        if col.startswith("Δ"):
            title, _, since = col[1:].partition("@")
            renamed[col] = f"delta_{names.get(title, title)}_since_{since}"
        else:
            renamed[col] = names.get(col, col)
    out = table.rename(columns=renamed)
    out.index.name = "layer"
    return out.reset_index()


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """JSON-ready rows (NaN -> null, numpy scalars -> Python)."""
    return json.loads(frame.to_json(orient="records", force_ascii=False))


def write_json(document: dict[str, Any]) -> None:
    """One JSON object on stdout."""
    sys.stdout.write(json.dumps(document, ensure_ascii=False, indent=2) + "\n")


def write_csv(frame: pd.DataFrame) -> None:
    """One CSV table on stdout (header row first)."""
    sys.stdout.write(frame.to_csv(index=False))


def show_layers(table: pd.DataFrame, title: str, fmt: str,
                document: dict[str, Any] | None = None) -> None:
    """The per-layer table in ``fmt``: rich tables + legend, or its machine form (the
    JSON object ``document`` plus ``"layers"``)."""
    from qkgeom.ui import render_layers

    if fmt == "table":
        render_layers(table, title, layer_legend([str(c) for c in table.columns]))
    elif fmt == "json":
        write_json({**(document or {}), "layers": records(machine_columns(table))})
    else:
        write_csv(machine_columns(table))
