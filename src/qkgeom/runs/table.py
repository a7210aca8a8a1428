"""Append-only run tables: ``metrics.parquet`` / ``train_log.parquet`` and their parts.

Rewriting a run's whole table at every probe makes a long run's I/O quadratic, so a flush
writes its rows as one part, ``<name>.parts/p<seq:010d>-L<level>.parquet``: parts apply in
``(seq, level)`` order over the base file, each replacing earlier rows of its steps;
:data:`FAN_IN` parts of a level merge into one of the next. Every file is written atomically
and a merge deletes its inputs only after its output is in place, so a kill leaves a
readable table (docs/faults.md#run-folder-durability-and-scale).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QKGeomError
from qkgeom.io import fsync_dir, make_dir, refuse_link, write_parquet
from qkgeom.runs.schema import check_table

if TYPE_CHECKING:
    import pandas as pd

FAN_IN = 16
PARTS_SUFFIX = ".parts"
_PART = re.compile(r"p(\d{10})-L(\d+)\.parquet")


def parts_dir(path: str | Path) -> Path:
    """``RUN/metrics.parts`` for ``RUN/metrics.parquet``."""
    path = Path(path)
    return path.with_name(path.name.removesuffix(".parquet") + PARTS_SUFFIX)


def numbered_files(folder: Path, pattern: re.Pattern[str]) -> list[tuple[Any, ...]]:
    """``(*numbers, file)`` of each file in ``folder`` whose whole name ``pattern`` matches
    (the numbers: its groups), sorted; a link is never one of them."""
    if not folder.is_dir():
        return []
    return sorted((*map(int, m.groups()), p) for p in folder.iterdir()
                  if (m := pattern.fullmatch(p.name)) and not p.is_symlink())


def list_parts(path: str | Path) -> list[tuple[int, int, Path]]:
    """``(seq, level, file)`` of every part of the table at ``path``, in the order applied."""
    return numbered_files(parts_dir(path), _PART)


def exists(path: str | Path) -> bool:
    """Whether the table has a base file or any part."""
    return Path(path).exists() or bool(list_parts(path))


def _read_file(file: Path, columns: tuple[str, ...]) -> pd.DataFrame:
    import pandas as pd

    try:
        frame = pd.read_parquet(file)
    except Exception as err:
        raise QKGeomError(f"{file}: unreadable Parquet ({type(err).__name__}); delete the run "
                          "folder and train again") from None
    check_table(frame, file, columns)
    return frame


def overlay(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """``frames`` applied in order: each one's rows replace earlier rows of its steps.
    Rows come out in step order (a stable sort: within a step, as written)."""
    import pandas as pd

    out = frames[0]
    for frame in frames[1:]:
        if len(frame) == 0:
            continue
        kept = out[~out["step"].isin(frame["step"].unique())]
        out = pd.concat([kept, frame], ignore_index=True) if len(kept) else frame
    if len(frames) > 1:
        out = out.sort_values("step", kind="stable")
    return out.reset_index(drop=True)


def read(path: str | Path, columns: tuple[str, ...] = ("step",)) -> pd.DataFrame | None:
    """The table at ``path`` with its parts laid over it; None when it has neither; a torn
    or foreign file is a one-line QKGeomError naming it."""
    path = Path(path)
    files = ([path] if path.exists() else []) + [p for _, _, p in list_parts(path)]
    if not files:
        return None
    return overlay([_read_file(f, columns) for f in files])


class TableWriter:
    """Appends parts to the table at ``path`` and compacts it (see the module doc)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.parts = parts_dir(self.path)
        found = list_parts(self.path)
        self._seq = found[-1][0] + 1 if found else 0

    def append(self, frame: pd.DataFrame) -> None:
        """Write ``frame`` as the newest part (its rows replace earlier rows of its steps)."""
        make_dir(self.parts)  # never into a linked parts folder
        write_parquet(self.parts / f"p{self._seq:010d}-L0.parquet", frame)
        self._seq += 1
        self._merge()

    def _merge(self) -> None:
        level = 0
        while True:
            same = [(s, p) for s, lv, p in list_parts(self.path) if lv == level]
            if len(same) < FAN_IN:
                return
            merged = overlay([_read_file(p, ("step",)) for _, p in same])
            write_parquet(self.parts / f"p{same[-1][0]:010d}-L{level + 1}.parquet", merged)
            for _, p in same:
                p.unlink(missing_ok=True)
            fsync_dir(self.parts)
            level += 1

    def compact(self, frame: pd.DataFrame) -> None:
        """Write the whole table ``frame`` as the base file and drop every part."""
        write_parquet(self.path, frame)
        self.drop_parts()

    def clear(self) -> None:
        """Remove the table: its base file and every part."""
        self.path.unlink(missing_ok=True)
        self.drop_parts()

    def drop_parts(self) -> None:
        refuse_link(self.parts)  # never delete through a link
        for _, _, p in list_parts(self.path):
            p.unlink(missing_ok=True)
        if self.parts.is_dir():
            fsync_dir(self.parts)
            if not any(self.parts.iterdir()):
                self.parts.rmdir()
