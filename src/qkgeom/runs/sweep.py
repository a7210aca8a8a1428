"""The sweep folder on disk: where runs, locks and the grid record live, and how to read them
(layout: docs/definitions.md#sweep-folder). A sweep folder may be shared or downloaded: none
of its entries may be a symbolic link (:func:`refuse_sweep_links`), and ``sweep.json`` is
read against its schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkgeom.io import read_json, refuse_link, refuse_links
from qkgeom.runs.schema import check_sweep_record

SWEEP_FILE = "sweep.json"
PACKING_FILE = "packing.json"
RUNS_DIR = "runs"
ATTEMPTS_FILE = "attempts.jsonl"
WORKER_LOG = "worker.log"
ERROR_LOG = "error.log"


def run_dir(out_dir: str | Path, run_id: str) -> Path:
    return Path(out_dir) / RUNS_DIR / run_id


def read_sweep_record(out_dir: str | Path) -> dict[str, Any]:
    """``sweep.json``: ``{"grid": {...}, "runs": [{"run_id", "axes", ...}]}``, checked
    (:func:`~qkgeom.runs.schema.check_sweep_record`); a one-line QKGeomError otherwise."""
    path = Path(out_dir) / SWEEP_FILE
    return check_sweep_record(read_json(path), path)


def sweep_experiment(out_dir: str | Path) -> str:
    """The experiment the sweep's grid declares (``e3``, ...), or ``""`` when it declares
    none or the folder is not a sweep."""
    if not (Path(out_dir) / SWEEP_FILE).is_file():
        return ""
    kind = read_sweep_record(out_dir)["grid"].get("experiment", "")
    return kind if isinstance(kind, str) else ""


def refuse_sweep_links(out_dir: str | Path, run_ids: list[str]) -> None:
    """One line (:class:`~qkgeom.io.LinkError`) naming the first symbolic link among the
    sweep folder's own entries, the run folders of ``run_ids``, their locks and what the
    run folders hold."""
    out = Path(out_dir)
    runs = out / RUNS_DIR
    for name in (SWEEP_FILE, PACKING_FILE, ".sweep.lock", RUNS_DIR, "report"):
        refuse_link(out / name)
    for rid in run_ids if runs.is_dir() else []:
        refuse_link(runs / rid)
        refuse_link(runs / f".{rid}.lock")
        refuse_links(runs / rid)
