"""One writer per run: an OS-level lock file beside the run folder.

``.<name>.lock`` sits beside ``<name>/`` (a fresh run refuses a non-empty folder), at the
folder's real path, so every alias of a folder meets one lock. Locks are ``flock`` locks:
the kernel drops them when their process dies, even on SIGKILL. The holder writes its pid
and host into the file, so a refused writer can say who holds the run. A lock file is
opened without following links and must be a plain file (:func:`qkgeom.io.open_private`);
readers (:func:`lock_is_held`, :func:`holder`) create, truncate and write nothing.
The guarantees and their tests: docs/faults.md#one-writer-per-run.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from qkgeom.errors import QKGeomError
from qkgeom.io import open_private

try:
    import fcntl
except ImportError:  # not POSIX: no flock, fall back on filelock's own locking
    fcntl = None  # type: ignore[assignment]

# Locks this process holds: lock file -> [file descriptor (or FileLock), hold count].
_HELD: dict[str, list[Any]] = {}
_GUARD = threading.Lock()
if hasattr(os, "register_at_fork"):  # a forked child holds nothing of its parent's
    os.register_at_fork(after_in_child=_HELD.clear)
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def lock_path(run: str | Path) -> Path:
    """``.<name>.lock`` beside the run folder's real path (every alias meets the same)."""
    real = Path(os.path.realpath(run))
    if not real.name:  # the filesystem root
        raise QKGeomError(f"{run}: a run folder cannot be the filesystem root")
    return real.with_name(f".{real.name}.lock")


def _lock(path: Path, blocking: bool) -> Any | None:
    """An open, exclusively locked handle on ``path``, or None when another process holds
    it (never, when ``blocking``)."""
    if fcntl is None:
        from filelock import FileLock, Timeout

        lock = FileLock(str(path), timeout=-1 if blocking else 0)
        try:
            lock.acquire()
        except Timeout:
            return None
        return lock
    fd = open_private(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BaseException as err:
        os.close(fd)
        if isinstance(err, OSError) and err.errno in _BUSY and not blocking:
            return None
        raise
    return fd


def _unlock(handle: Any, clear: bool = True) -> None:
    if fcntl is None:
        handle.release()
        return
    if clear:
        os.ftruncate(handle, 0)  # nobody holds it now; a stale holder would mislead
    fcntl.flock(handle, fcntl.LOCK_UN)
    os.close(handle)


class RunLock:
    """Non-blocking per-run lock: ``acquire()`` says whether this process now holds it.
    Exclusive also between two holders in one process, unless one joins the other's hold
    (``acquire(reentrant=True)``: the trainer a sweep worker calls inside its lock).
    ``path``: the lock file, when not beside the run folder (the monitor keeps its own)."""

    def __init__(self, run: str | Path, path: str | Path | None = None) -> None:
        self.run = Path(run)
        self.path = (Path(os.path.realpath(Path(path).parent)) / Path(path).name if path is not None
                     else lock_path(run))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._key = str(self.path)
        self._mine = False

    def acquire(self, reentrant: bool = False) -> bool:
        """Take the lock; False when it is held elsewhere."""
        with _GUARD:
            if self._mine:
                return True
            entry = _HELD.get(self._key)
            if entry is not None and not reentrant:
                return False
            if entry is None:
                handle = _lock(self.path, blocking=False)
                if handle is None:
                    return False
                if fcntl is not None:
                    os.ftruncate(handle, 0)
                    os.pwrite(handle, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                  "since": time.time()}).encode(), 0)
                entry = _HELD[self._key] = [handle, 0]
            entry[1] += 1
            self._mine = True
            return True

    def release(self) -> None:
        with _GUARD:
            if not self._mine:
                return
            self._mine = False
            entry = _HELD[self._key]
            entry[1] -= 1
            if entry[1] == 0:
                del _HELD[self._key]
                _unlock(entry[0])

    def require(self, action: str = "write", reentrant: bool = False) -> RunLock:
        """Acquire, or raise a one-line QKGeomError naming the process that holds the run."""
        if not self.acquire(reentrant):
            raise QKGeomError(f"{self.run}: another process is writing this run "
                              f"({_holder(self.path)}); wait for it to finish or stop it, then "
                              f"{action} again")
        return self

    def __enter__(self) -> RunLock:
        return self.require()

    def __exit__(self, *_: Any) -> None:
        self.release()


def _open_to_read(path: Path) -> int | None:
    """A read-only descriptor on the lock file, or None (missing, a link, not a plain
    file, unreadable): nothing is created or changed."""
    try:
        return open_private(path, os.O_RDONLY)
    except (OSError, QKGeomError):
        return None


def holder(run: str | Path) -> str:
    """Who holds the run's lock, as the holder wrote it: ``pid 123 on host h``."""
    return _holder(lock_path(run))


def _holder(path: Path) -> str:
    fd = _open_to_read(path)
    info: Any = {}
    if fd is not None:
        try:
            info = json.loads(os.read(fd, 4096).decode("utf-8") or "{}")
        except (OSError, ValueError):
            info = {}
        finally:
            os.close(fd)
    pid, host = (info.get("pid"), info.get("host", "?")) if isinstance(info, dict) else (None, "")
    if not isinstance(pid, int) or not isinstance(host, str):
        return "holder unknown"
    return f"pid {pid} on host {host[:64]}"


def lock_is_held(run: str | Path) -> bool:
    """Whether a process (this one included) holds the run's lock now. Read-only: a shared
    lock tried on a read-only descriptor and dropped at once; a missing lock file, or one
    that is a link or not a plain file, means nobody holds the run through it."""
    path = lock_path(run)
    with _GUARD:
        if str(path) in _HELD:
            return True
    if fcntl is None:  # filelock's own locking: probe with a second lock
        lock = RunLock(run)
        if lock.acquire():
            lock.release()
            return False
        return True
    fd = _open_to_read(path)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        return err.errno in _BUSY
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class FolderLock:
    """A blocking exclusive lock on a file (``with FolderLock(path):``) for short critical
    sections, such as creating ``sweep.json`` once when two sweeps start together. Opened
    like a run's lock (never through a link); nothing is written into it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._handle: Any = None

    def __enter__(self) -> FolderLock:
        self._handle = _lock(self.path, blocking=True)
        return self

    def __exit__(self, *_: Any) -> None:
        _unlock(self._handle, clear=False)
        self._handle = None
