"""The sweep folder on disk: where runs, locks and the grid record live, and how to read them.

::

    SWEEP/
      sweep.json              the grid, every run id with its axes and config hash, created
      runs/<run_id>/          a normal run folder (config.json, metrics.parquet, status.json,
                              train_log.parquet, checkpoints/) plus the sweep's own
                              attempts.jsonl (one line per training attempt), worker.log
                              (the worker's stderr) and error.log (traceback of a failure)
      runs/.<run_id>.lock     the run's lock, held while a process trains it

The lock sits *beside* the run folder, not in it, because the trainer refuses to start a
fresh run in a non-empty folder; it is a dot-file so that listings of ``runs/`` show runs. Locks are ``flock`` locks (through ``filelock``): the
kernel drops them when their process dies, even on SIGKILL, so a killed sweep leaves no
stale lock behind. On a cluster the sweep folder must be on a filesystem every node sees
and that supports ``flock`` across nodes (NFSv4, Lustre, GPFS, CephFS do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from qkgeom.errors import QKGeomError
from qkgeom.io import read_json

SWEEP_FILE = "sweep.json"
RUNS_DIR = "runs"
ATTEMPTS_FILE = "attempts.jsonl"
WORKER_LOG = "worker.log"
ERROR_LOG = "error.log"
# States a run folder can record (status.json); "failed" is written by the sweep runner.
FINAL_STATES = ("done", "diverged", "failed")


def run_dir(out_dir: str | Path, run_id: str) -> Path:
    return Path(out_dir) / RUNS_DIR / run_id


def lock_path(run: str | Path) -> Path:
    run = Path(run)
    return run.with_name(f".{run.name}.lock")


def read_status(run: str | Path) -> dict[str, Any] | None:
    """The run's status.json, or None when it has none (never started) or it is unreadable.

    An unreadable status (cannot happen with atomic writes, but a user may edit it) reads as
    "never finished": the run is resumed from its newest checkpoint, which is cheap and safe.
    """
    path = Path(run) / "status.json"
    if not path.exists():
        return None
    try:
        status = read_json(path)
    except QKGeomError:
        return None
    return status if isinstance(status, dict) else None


class RunLock:
    """Non-blocking per-run lock: ``acquire()`` says whether this process now holds it."""

    def __init__(self, run: str | Path) -> None:
        path = lock_path(run)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = FileLock(str(path), timeout=0)

    def acquire(self) -> bool:
        try:
            self._lock.acquire()
        except Timeout:
            return False
        return True

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release()


def lock_is_held(run: str | Path) -> bool:
    """Whether another process holds the run's lock right now (it is training the run)."""
    if not lock_path(run).exists():
        return False
    lock = RunLock(run)
    try:
        if lock.acquire():
            lock.release()
            return False
    except OSError:  # a read-only sweep folder: cannot tell, assume nobody holds it
        return False
    return True
