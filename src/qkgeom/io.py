"""Atomic file writes, no write through a link, and reads that fail in one line.

A run killed mid-write (pre-emption, Ctrl-C, a full disk) must never leave a torn result
behind, so every writer goes through a temp file beside its target (``.<name>.<8
characters>.tmp``, the only names a resume may delete as leftovers) and ``os.replace``; a
write the filesystem refuses is a one-line :class:`~qkgeom.errors.StorageError` and leaves
the old file intact. A result folder may come from someone else, so nothing written in one
follows a symbolic link planted there (docs/faults.md#links-and-crafted-folders). Tests
inject faults into the writes through ``QKGEOM_FAULT`` (docs/faults.md#fault-injection).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import signal
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkgeom.errors import QKGeomError, StorageError

_UMASK = os.umask(0)  # reading the umask means setting it: set it back at once
os.umask(_UMASK)
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
    """Make a rename or unlink in ``folder`` durable (fsync the directory: else a power cut
    after ``os.replace`` can bring back the old file); skipped where that is impossible."""
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


_FAULT_ACTIONS = ("kill", "enospc", "erofs", "pause")


def fault_entries(spec: str) -> list[tuple[str, str, str, int]]:
    """``QKGEOM_FAULT`` parsed: ``(entry, action, glob, n)`` per comma-separated entry; a
    malformed one is a one-line QKGeomError (a typo must not pass as "no fault")."""
    out = []
    for entry in spec.split(","):
        if not entry.strip():
            continue
        action, _, rest = entry.strip().partition(":")
        pattern, _, nth = rest.partition(":")
        if action not in _FAULT_ACTIONS or not pattern or not (nth or "1").isdigit() \
                or int(nth or 1) < 1:
            raise QKGeomError(f"{_FAULT_ENV}={spec!r}: {entry.strip()!r} is not action:glob[:n] "
                              f"(action one of {', '.join(_FAULT_ACTIONS)}, n >= 1); unset it "
                              "or fix it")
        if action == "pause" and not os.environ.get(_FAULT_PAUSE_ENV):
            raise QKGeomError(f"{_FAULT_ENV}: a pause fault needs {_FAULT_PAUSE_ENV} (a flag "
                              "file path)")
        out.append((entry, action, pattern, int(nth or 1)))
    return out


def _inject_fault(path: Path, tmp_path: Path) -> None:
    """Apply ``QKGEOM_FAULT`` (see the module doc) to this write of ``path``, if it matches."""
    spec = os.environ.get(_FAULT_ENV)
    if not spec:
        return
    once = os.environ.get(_FAULT_ONCE_ENV)
    if once and os.path.exists(once):
        return
    for entry, action, pattern, nth in fault_entries(spec):
        if not fnmatch.fnmatch(path.name, pattern):
            continue
        _fault_counts[entry] = count = _fault_counts.get(entry, 0) + 1
        if count < nth or (action in ("kill", "pause") and count > nth):
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


class LinkError(QKGeomError):
    """A symbolic link where qkgeom would write (a file or a folder inside a result folder)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(f"{path}: is a symbolic link; qkgeom never writes through a link "
                         "found in a folder it writes (it could point at any file): remove "
                         "the link, or use a folder without it")


def refuse_link(path: str | Path) -> None:
    """:class:`LinkError` when ``path`` is a symbolic link (dangling or not)."""
    if os.path.islink(path):
        raise LinkError(path)


def links_in(folder: str | Path) -> list[Path]:
    """The symbolic links among ``folder``'s entries and one level inside each of its real
    sub-folders, sorted (none when it is not a folder): what a result folder must not
    hold before qkgeom writes into it."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        if entry.is_symlink():
            found.append(entry)
        elif entry.is_dir():
            found.extend(p for p in entry.iterdir() if p.is_symlink())
    return sorted(found)


def refuse_links(folder: str | Path) -> None:
    """:class:`LinkError` naming the first of :func:`links_in`: nothing qkgeom writes in a
    result folder is a link, and writing through one could overwrite any file."""
    links = links_in(folder)
    if links:
        raise LinkError(links[0])


def make_dir(path: str | Path) -> Path:
    """``path`` as a folder (created with its parents if missing), refusing a link there:
    for the sub-folders qkgeom writes into (``checkpoints/``, ``report/``, ``runs/`` ...)."""
    path = Path(path)
    refuse_link(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise QKGeomError(f"{path}: exists and is not a folder") from None
    except OSError as err:
        raise _os_error(path, err) from None
    return path


def _os_error(path: str | Path, err: OSError) -> QKGeomError:
    """An OSError of a write as one line: a storage error (disk, permissions) or, for
    anything else (a file where a folder should be ...), the reason as the OS gives it."""
    if err.errno in StorageError.ERRNOS:
        return StorageError.of(path, err)
    if err.errno in (errno.EEXIST, errno.ENOTDIR):
        return QKGeomError(f"{path}: cannot write (a file is where a folder should be on "
                           "that path); choose another place")
    return QKGeomError(f"{path}: cannot write ({err.strerror or type(err).__name__})")


def open_private(path: str | Path, flags: int, mode: int = 0o666) -> int:
    """``os.open(path, flags)`` of a file qkgeom appends to or locks inside a result folder:
    a link, a file with other hard links (another name for someone's file) or anything but
    a plain file (a FIFO would block) is refused in one line."""
    path = Path(path)
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags | nofollow | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as err:
        if err.errno == errno.ELOOP or os.path.islink(path):
            raise LinkError(path) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise QKGeomError(f"{path}: is not a plain file; qkgeom writes only plain files "
                              "here: remove it")
        if info.st_nlink > 1 and flags & (os.O_WRONLY | os.O_RDWR):
            raise QKGeomError(f"{path}: has other hard links (another name for some file); "
                              "qkgeom does not write into it: remove it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def append_file(path: str | Path) -> Any:
    """A binary file object appending to ``path`` (created if missing) without following a
    link (:func:`open_private`); storage errors are one line."""
    try:
        fd = open_private(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError as err:
        raise _os_error(path, err) from None
    return os.fdopen(fd, "ab")


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)``, then move it onto ``path`` atomically and durably (data
    synced before the rename, the folder after), with ``open()``'s permissions rather than
    ``mkstemp``'s 0600 so collaborators can read results. A ``path`` that is a link is
    refused (:class:`LinkError`)."""
    path = Path(path)
    refuse_link(path)
    try:
        if not path.parent.is_dir():
            refuse_link(path.parent)  # a dangling link where the folder should be
            path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise _os_error(path, err) from None
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


#: The largest JSON record qkgeom reads from a result folder (its own are a few kB; a
#: sweep.json of 10,000 runs about 3 MB): a bigger file is refused, not parsed.
MAX_JSON_BYTES = 64 * 2**20


def read_file(path: str | Path, limit: int = -1) -> bytes:
    """The bytes of ``path`` (at most ``limit``); missing or unreadable: one line."""
    try:
        with open(path, "rb") as fh:
            return fh.read(limit)
    except FileNotFoundError:
        raise QKGeomError(f"{path}: file not found") from None
    except OSError as err:
        raise QKGeomError(f"{path}: cannot be read ({err.strerror})") from None


def read_json(path: str | Path) -> Any:
    """Read JSON, turning a missing, torn or oversized file into a one-line QKGeomError."""
    path = Path(path)
    data = read_file(path, MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise QKGeomError(f"{path}: larger than {MAX_JSON_BYTES // 2**20} MiB; not a record "
                          "qkgeom wrote")
    try:
        return json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise QKGeomError(f"{path}: not valid JSON ({err}); the file is corrupt") from None
    except RecursionError:
        raise QKGeomError(f"{path}: not valid JSON (nested too deeply); the file is "
                          "corrupt") from None
