"""The sweep folder on disk: where runs, locks and the grid record live, and how to read them.

::

    SWEEP/
      sweep.json              the grid, every run id with its axes and config hash, created
      packing.json            runs per GPU measured for --runs-per-gpu auto (if asked for)
      runs/<run_id>/          a normal run folder (config.json, metrics.parquet, status.json,
                              train_log.parquet, checkpoints/) plus the sweep's own
                              attempts.jsonl (one line per training attempt), worker.log
                              (the worker's stderr) and error.log (traceback of a failure)
      runs/.<run_id>.lock     the run's lock, held while a process trains it

Run folders, their status and their locks are :mod:`qkgeom.runs`'s; this module knows only
where a sweep keeps them. On a cluster the sweep folder must be on a filesystem every node
sees and that supports ``flock`` across nodes (NFSv4, Lustre, GPFS, CephFS do).

A sweep folder may be shared or downloaded: none of the entries above may be a symbolic
link (:func:`refuse_sweep_links`, before a sweep writes anything), and ``sweep.json`` is
read against its schema (:func:`read_sweep_record`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkgeom.errors import QKGeomError
from qkgeom.io import LinkError, links_in, read_json
from qkgeom.runs.schema import check_sweep_record

SWEEP_FILE = "sweep.json"
PACKING_FILE = "packing.json"
RUNS_DIR = "runs"
ATTEMPTS_FILE = "attempts.jsonl"
WORKER_LOG = "worker.log"
ERROR_LOG = "error.log"
#: The experiments a grid may declare (``experiment:``), so its report is theirs.
EXPERIMENT_NAMES = ("e1", "e3", "e4", "stability")


def run_dir(out_dir: str | Path, run_id: str) -> Path:
    return Path(out_dir) / RUNS_DIR / run_id


def read_sweep_record(out_dir: str | Path) -> dict[str, Any]:
    """``sweep.json`` checked against its schema (a mapping; each run entry a mapping with a
    plain ``run_id`` folder name, ...): a one-line QKGeomError naming the file otherwise."""
    path = Path(out_dir) / SWEEP_FILE
    record = check_sweep_record(read_json(path), path)
    runs = record.get("runs", [])
    for entry in runs if isinstance(runs, list) else []:
        rid = entry if isinstance(entry, str) else entry["run_id"]
        if not rid or rid in (".", "..") or any(c in rid for c in "/\\\0"):
            raise QKGeomError(f"{path}: run id {rid[:40]!r} is not a folder name; the file "
                              "is corrupt or not qkgeom's")
    return record


def sweep_experiment(out_dir: str | Path) -> str:
    """The experiment the sweep's grid declares (``e1``, ``e3``, ``e4``), or ``""`` when it
    declares none or the folder is not a sweep."""
    if not (Path(out_dir) / SWEEP_FILE).is_file():
        return ""
    grid = read_sweep_record(out_dir).get("grid")
    kind = grid.get("experiment", "") if isinstance(grid, dict) else ""
    return kind if kind in EXPERIMENT_NAMES else ""


def refuse_sweep_links(out_dir: str | Path, run_ids: list[str]) -> None:
    """One line (:class:`~qkgeom.io.LinkError`) naming the first symbolic link among the
    sweep folder's own entries (``sweep.json``, ``packing.json``, ``.sweep.lock``, ``runs/``,
    ``report/``), the run folders of ``run_ids`` and their locks, and inside those run
    folders (:func:`qkgeom.io.links_in`)."""
    out = Path(out_dir)
    if not out.is_dir():
        return
    for name in (SWEEP_FILE, PACKING_FILE, ".sweep.lock", RUNS_DIR, "report"):
        if (out / name).is_symlink():
            raise LinkError(out / name)
    runs = out / RUNS_DIR
    if not runs.is_dir():
        return
    for rid in run_ids:
        for path in (runs / rid, runs / f".{rid}.lock"):
            if path.is_symlink():
                raise LinkError(path)
        links = links_in(runs / rid)
        if links:
            raise LinkError(links[0])
