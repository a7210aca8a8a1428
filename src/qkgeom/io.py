"""Atomic file writes (a result file is either the old one or the complete new one), and
JSON reads that fail in one line.

A run killed mid-write (pre-emption, Ctrl-C, disk full) must never leave a torn
``metrics.parquet`` or checkpoint behind, so every writer goes through a temp file in the
same folder followed by ``os.replace`` (atomic on POSIX).

A write the filesystem refuses (disk full, read-only folder, no permission) raises
:class:`~qkgeom.errors.StorageError`, a one-line error naming the file; the file it would
have replaced is left as it was, so a run's last good checkpoint survives.

Fault injection for tests (``tests/faults``): the environment variable ``QKGEOM_FAULT``
holds comma-separated ``action:glob[:n]`` entries, matched against the *name* of each file
written here. ``enospc:GLOB:N`` makes the Nth matching write and every later one fail
half-way with ``OSError(ENOSPC)`` (a disk that stays full), ``erofs:GLOB:N`` likewise
with ``OSError(EROFS)`` (a folder that turned read-only); ``kill:GLOB:N`` SIGKILLs the
process half-way through the Nth matching write (the temp file is torn, the target is
untouched). ``n`` defaults to 1. Unset (the normal case), it costs one dict lookup.
``pause:GLOB:N`` holds the Nth matching write (the temp file written, the target not yet
replaced) until a file flag says go: it creates ``$QKGEOM_FAULT_PAUSE.waiting`` and waits
for ``$QKGEOM_FAULT_PAUSE.go`` (a second writer can then be tried while the first is
mid-run). ``QKGEOM_FAULT_ONCE`` (a file path) makes the faults fire only while that file
does not exist, and creates it when one fires: a fault that takes down one process and not
the one that retries it (a Ray task's retry, a resumed run).

Temp files are named ``.<name>.<8 random characters>.tmp`` beside their target
(:func:`temp_name_pattern`): the only files a resumed run may delete as leftovers of a
killed write, so a user's own ``*.tmp`` files are never touched.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkgeom.errors import QKGeomError, StorageError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()
_FAULT_ENV = "QKGEOM_FAULT"
_FAULT_ONCE_ENV = "QKGEOM_FAULT_ONCE"
_FAULT_PAUSE_ENV = "QKGEOM_FAULT_PAUSE"
_fault_counts: dict[str, int] = {}
_TMP_SUFFIX_CHARS = 8  # tempfile.mkstemp's random part: [a-z0-9_]{8}


def temp_name_pattern(names: str) -> re.Pattern[str]:
    """The names :func:`atomic_write` gives its temp files for a target whose name matches
    the regular expression ``names`` (e.g. ``r"ckpt_\\d{8}\\.pt"``)."""
    return re.compile(rf"\.(?:{names})\.[a-z0-9_]{{{_TMP_SUFFIX_CHARS}}}\.tmp")


def fsync_dir(folder: str | Path) -> None:
    """Make a rename or unlink in ``folder`` durable (POSIX: fsync the directory).

    Without it a power cut right after ``os.replace`` can bring back the old file (or
    none), although the new one's data was synced. Filesystems or platforms that cannot
    open or sync a directory are skipped silently: there is nothing more to do there."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _inject_fault(path: Path, tmp_path: Path) -> None:
    """Apply ``QKGEOM_FAULT`` (see the module doc) to this write of ``path``, if it matches."""
    spec = os.environ.get(_FAULT_ENV)
    if not spec:
        return
    once = os.environ.get(_FAULT_ONCE_ENV)
    if once and os.path.exists(once):
        return
    for entry in spec.split(","):
        action, _, rest = entry.strip().partition(":")
        pattern, _, nth = rest.partition(":")
        if not fnmatch.fnmatch(path.name, pattern):
            continue
        _fault_counts[entry] = count = _fault_counts.get(entry, 0) + 1
        if count < int(nth or 1) or (action in ("kill", "pause") and count > int(nth or 1)):
            continue
        if action == "pause":
            _pause(os.environ[_FAULT_PAUSE_ENV])
            continue
        size = tmp_path.stat().st_size
        os.truncate(tmp_path, size // 2)  # a torn temp file, as a real failure leaves
        if once:
            Path(once).touch()
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action in ("enospc", "erofs"):
            code = errno.ENOSPC if action == "enospc" else errno.EROFS
            raise OSError(code, os.strerror(code), str(path))


def _pause(flag: str, timeout: float = 600.0) -> None:
    """Say ``flag.waiting``, then wait for ``flag.go`` (tests only: ``pause`` faults)."""
    import time

    Path(f"{flag}.waiting").touch()
    deadline = time.monotonic() + timeout
    while not os.path.exists(f"{flag}.go") and time.monotonic() < deadline:
        time.sleep(0.01)


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)`` then atomically move ``tmp_path`` onto ``path``.

    The file gets the permissions a plain ``open(path, "w")`` would (0666 minus the umask),
    not ``mkstemp``'s owner-only 0600, so results stay readable by collaborators. The file's
    data is fsynced before the rename and the folder after it, so a completed write
    survives a power cut.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise StorageError.of(path, err) from None
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        _inject_fault(path, tmp_path)
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp_path, 0o666 & ~_UMASK)
        os.replace(tmp_path, path)
        fsync_dir(path.parent)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp_path.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno in StorageError.ERRNOS:
            raise StorageError.of(path, err) from None
        raise


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write raw bytes atomically."""
    atomic_write(path, lambda p: p.write_bytes(data))


def write_parquet(path: str | Path, frame: Any) -> None:
    """Write a pandas DataFrame as Parquet, atomically."""
    atomic_write(path, lambda p: frame.to_parquet(p, index=False))


def read_json(path: str | Path) -> Any:
    """Read JSON, turning a missing or torn file into a one-line QKGeomError."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QKGeomError(f"{path}: file not found") from None
    except OSError as err:
        raise QKGeomError(f"{path}: cannot be read ({err.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise QKGeomError(f"{path}: not valid JSON ({err}); the file is corrupt") from None
