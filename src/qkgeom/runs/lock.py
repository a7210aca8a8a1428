"""One writer per run: an OS-level lock file beside the run folder.

The lock sits *beside* the run folder (``.<name>.lock`` next to ``<name>/``), not in it,
because a fresh run refuses a non-empty folder; it is a dot-file so listings show runs.
Locks are ``flock`` locks (through ``filelock``): the kernel drops them when their process
dies, even on SIGKILL, so a killed run leaves no stale lock behind. On a cluster the folder
must be on a filesystem that supports ``flock`` across nodes (NFSv4, Lustre, GPFS, CephFS).
"""

from __future__ import annotations

from pathlib import Path

from filelock import FileLock, Timeout


def lock_path(run: str | Path) -> Path:
    run = Path(run)
    return run.with_name(f".{run.name}.lock")


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
    """Whether another process holds the run's lock right now (it is writing the run)."""
    if not lock_path(run).exists():
        return False
    lock = RunLock(run)
    try:
        if lock.acquire():
            lock.release()
            return False
    except OSError:  # a read-only folder: cannot tell, assume nobody holds it
        return False
    return True
