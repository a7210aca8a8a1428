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
"""

from __future__ import annotations

from pathlib import Path

SWEEP_FILE = "sweep.json"
PACKING_FILE = "packing.json"
RUNS_DIR = "runs"
ATTEMPTS_FILE = "attempts.jsonl"
WORKER_LOG = "worker.log"
ERROR_LOG = "error.log"


def run_dir(out_dir: str | Path, run_id: str) -> Path:
    return Path(out_dir) / RUNS_DIR / run_id
