"""One writer per run: an OS-level lock file beside the run folder.

The lock sits *beside* the run folder (``.<name>.lock`` next to ``<name>/``), not in it,
because a fresh run refuses a non-empty folder; it is a dot-file so listings show runs.
Every writer of a run folder takes it: ``qkgeom train`` (fresh and ``--resume``), a
sweep's worker, the :class:`~qkgeom.monitor.GeometryMonitor`'s run folder. Locks are
``flock`` locks: the kernel drops them when their process dies, even on SIGKILL, so a
killed run leaves no stale lock behind. The holder writes its pid, host and start time
into the lock file, so a refused writer can say who holds the run. On a cluster the folder
must be on a filesystem that supports ``flock`` across nodes (NFSv4, Lustre, GPFS, CephFS).

The lock is exclusive, also between two holders in one process; a holder that works for
the one already holding it joins it instead (``acquire(reentrant=True)``: the trainer a
sweep worker calls, inside the worker's lock).

The lock belongs to the folder, not to the path that names it: it lies beside the folder's
real path (symbolic links in the path resolved), so ``alias -> runs/a`` and ``runs/a`` meet
one lock. The lock file is opened without following links and must be a plain file
(:func:`qkgeom.io.open_private`): a planted ``.a.lock -> ~/thesis.tex`` is refused in one
line, never truncated. Readers (:func:`lock_is_held`, :func:`holder`: ``sweep status``,
``watch``) open it read-only and create, truncate or write nothing.
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


def lock_path(run: str | Path) -> Path:
    """``.<name>.lock`` beside the run folder's real path (every alias meets the same)."""
    real = Path(os.path.realpath(run))
    if not real.name:  # the filesystem root
        raise QKGeomError(f"{run}: a run folder cannot be the filesystem root")
    return real.with_name(f".{real.name}.lock")


def _try_lock(path: Path) -> Any | None:
    """An open, exclusively locked handle on ``path`` with this process as its holder, or
    None when another process holds it."""
    if fcntl is None:
        from filelock import FileLock, Timeout

        lock = FileLock(str(path), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            return None
        return lock
    fd = open_private(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "since": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder, 0)
    return fd


def _unlock(handle: Any) -> None:
    if fcntl is None:
        handle.release()
        return
    os.ftruncate(handle, 0)  # nobody holds it now; a stale holder would mislead
    fcntl.flock(handle, fcntl.LOCK_UN)
    os.close(handle)


class RunLock:
    """Non-blocking per-run lock: ``acquire()`` says whether this process now holds it."""

    def __init__(self, run: str | Path, path: str | Path | None = None) -> None:
        """``path``: the lock file, when not the default beside the run folder
        (:func:`lock_path`; the monitor keeps its lock inside its own folder)."""
        self.run = Path(run)
        self.path = (Path(os.path.realpath(Path(path).parent)) / Path(path).name if path is not None
                     else lock_path(run))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._key = str(self.path)
        self._mine = False

    def acquire(self, reentrant: bool = False) -> bool:
        """Take the lock; False when it is held elsewhere (by another process, or by another
        holder in this one unless ``reentrant``, which joins this process's hold)."""
        with _GUARD:
            if self._mine:
                return True
            entry = _HELD.get(self._key)
            if entry is not None and not reentrant:
                return False
            if entry is None:
                handle = _try_lock(self.path)
                if handle is None:
                    return False
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
    """Whether a process (this one included) holds the run's lock right now (it is
    writing the run). Read-only: tries a shared lock on a read-only descriptor and drops
    it at once; a missing lock file, or one that is a link or not a plain file, means
    nobody holds the run through it."""
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
        return err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class FolderLock:
    """A blocking exclusive lock on a file in a folder (``with FolderLock(path):``), for
    short critical sections such as creating ``sweep.json`` once when two sweep processes
    start together. The file is opened like a run's lock (never through a link) and
    nothing is written into it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._handle: Any = None

    def __enter__(self) -> FolderLock:
        if fcntl is None:
            from filelock import FileLock

            self._handle = FileLock(str(self.path))
            self._handle.acquire()
            return self
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._handle = fd
        return self

    def __exit__(self, *_: Any) -> None:
        if fcntl is None:
            self._handle.release()
        else:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            os.close(self._handle)
        self._handle = None
