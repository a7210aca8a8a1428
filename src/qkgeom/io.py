"""Atomic file writes: a result file is either the old one or the complete new one.

A run killed mid-write (pre-emption, Ctrl-C, disk full) must never leave a torn
``metrics.parquet`` or checkpoint behind, so every writer goes through a temp file in the
same folder followed by ``os.replace`` (atomic on POSIX).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)`` then atomically move ``tmp_path`` onto ``path``.

    The file gets the permissions a plain ``open(path, "w")`` would (0666 minus the umask),
    not ``mkstemp``'s owner-only 0600, so results stay readable by collaborators.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp_path, 0o666 & ~_UMASK)
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
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
    from qkgeom.errors import QKGeomError

    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QKGeomError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise QKGeomError(f"{path}: not valid JSON ({err}); the file is corrupt") from None
