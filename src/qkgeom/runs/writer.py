"""The tables and status of a run folder while a run writes them (trainer or monitor).

Every write is atomic, so a run killed at any moment leaves complete files; the tables grow
by parts (:mod:`.table`) and are compacted when the run ends or resumes. The status records
the start, the wall time summed over resumed attempts and the attempt's thread count.
:meth:`RunWriter.status` is the only code that writes a run's state (:func:`record_failed`
for a run whose trainer could not).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from qkgeom.errors import QKGeomError
from qkgeom.io import write_json
from qkgeom.runs.folder import (
    LOG_COLUMNS,
    METRIC_COLUMNS,
    METRICS,
    STATUS,
    TRAIN_LOG,
    read_log,
    read_metrics,
    status_of,
)
from qkgeom.runs.table import TableWriter

#: Longest wall time between two writes of a live run's status (:meth:`RunWriter.heartbeat`):
#: between probes ``status.json`` still says how far the run got, so ``watch``, ``runs``
#: and ``sweep status`` tell a live run from a hung one.
HEARTBEAT_S = 30.0


class RunWriter:
    """Accumulates a run's metrics and log rows and writes them, with its status, to ``out``
    (whose config.json the caller writes). ``steps``: the planned length; ``resume``: the
    earlier attempt's start and wall time carry over; ``threads``: recorded in the status
    (resuming with another count can change the last bits of the results)."""

    def __init__(self, out: str | Path, run_id: str, *, steps: int = 0,
                 resume: bool = False, threads: int | None = None,
                 heartbeat_s: float | None = None) -> None:
        self.out, self.run_id, self.steps, self.threads = Path(out), run_id, steps, threads
        self.heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        self._beat: tuple[float, dict[str, Any]] | None = None  # last running status: when, extras
        # table -> step -> its rows: a frame of metrics, a list of log rows
        self._rows: dict[str, dict[int, Any]] = {"metrics": {}, "log": {}}
        self._dirty: dict[str, set[int]] = {"metrics": set(), "log": set()}
        self._tables = {"metrics": TableWriter(self.out / METRICS),
                        "log": TableWriter(self.out / TRAIN_LOG)}
        # a status that is not qkgeom's (garbage, wrong types: its schema) is rewritten
        self.previous = prev = (status_of(self.out)[0] or {}) if resume else {}
        self.started = prev.get("started", time.time())
        self._wall_before = float(prev.get("wall_s", 0.0))
        self._t0 = time.perf_counter()

    def read_previous(self, upto: int | None = None
                      ) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
        """The tables an earlier attempt wrote (rows with ``step <= upto``), read and
        checked but not taken up: a resume reads them before it writes anything."""
        return read_metrics(self.out, upto, missing_ok=True), read_log(self.out, upto)

    def restore(self, upto: int | None = None,
                tables: tuple[pd.DataFrame | None, pd.DataFrame | None] | None = None) -> None:
        """Take up the tables an earlier attempt wrote (rows with ``step <= upto``, or
        ``tables`` from :meth:`read_previous`) and compact them: later rows (recomputed by
        this attempt) are dropped on disk, and a table left empty is removed."""
        metrics, log = tables if tables is not None else self.read_previous(upto)
        self._rows = {"metrics": ({int(s): rows for s, rows in metrics.groupby("step", sort=False)}
                                  if metrics is not None else {}), "log": {}}
        for row in (log.to_dict("records") if log is not None else []):
            self._rows["log"].setdefault(int(row["step"]), []).append(row)
        self._dirty = {"metrics": set(), "log": set()}
        for name in self._tables:
            frame = self._frame(name, self._rows[name])
            if len(frame):
                self._tables[name].compact(frame)
            else:
                self._tables[name].clear()

    def add_metrics(self, frame: pd.DataFrame, step: int, *, replace: bool = False) -> None:
        """Append long-format rows of one probe at ``step`` (``replace``: drop earlier rows of
        that step first). ``run_id`` and ``step`` columns are set here."""
        step = int(step)
        rows = frame.assign(run_id=self.run_id, step=step)[METRIC_COLUMNS]
        if step in self._rows["metrics"] and not replace:
            rows = pd.concat([self._rows["metrics"][step], rows], ignore_index=True)
        self._rows["metrics"][step] = rows
        self._dirty["metrics"].add(step)

    def add_log(self, row: dict[str, float]) -> None:
        """One ``train_log`` row (missing columns are NaN)."""
        full = {c: float(row.get(c, float("nan"))) for c in LOG_COLUMNS}
        step = int(full["step"])
        self._rows["log"].setdefault(step, []).append(full)
        self._dirty["log"].add(step)

    def _frame(self, name: str, steps: Iterable[int]) -> pd.DataFrame:
        """The rows of ``steps`` of table ``name``, in step order."""
        rows, steps = self._rows[name], sorted(steps)
        if name == "log":
            frame = pd.DataFrame([r for s in steps for r in rows[s]], columns=LOG_COLUMNS)
            return frame.astype({"step": "int64"}) if len(frame) else frame
        if not steps:
            return pd.DataFrame(columns=METRIC_COLUMNS)
        return pd.concat([rows[s] for s in steps], ignore_index=True)

    @property
    def metrics(self) -> pd.DataFrame:
        """Every metric row so far, in step order."""
        return self._frame("metrics", self._rows["metrics"])

    @property
    def log(self) -> pd.DataFrame:
        """Every log row so far, in step order."""
        return self._frame("log", self._rows["log"])

    def flush(self) -> None:
        """Write the rows added since the last flush as one part per table (every row of
        each step touched, so a part replaces its steps whole)."""
        for name, steps in self._dirty.items():
            if steps:
                self._tables[name].append(self._frame(name, steps))
        self._dirty = {"metrics": set(), "log": set()}

    def compact(self) -> None:
        """Write each table that has rows whole and drop its parts (at the end of a run, so
        the plain files are complete; readers see the same rows before and after)."""
        self.flush()
        for name, rows in self._rows.items():
            if rows:
                self._tables[name].compact(self._frame(name, rows))

    def status(self, state: str, step: int, **extra: Any) -> dict[str, Any]:
        """Write ``status.json`` (state, step, planned steps, start and wall time, threads,
        extras) and return it: the one writer of a run's state."""
        record = {"state": state, "step": int(step), "steps": max(self.steps, int(step)),
                  "started": self.started, "updated": time.time(),
                  "wall_s": self._wall_before + time.perf_counter() - self._t0, **extra}
        if self.threads is not None:
            record["threads"] = int(self.threads)
        write_json(self.out / STATUS, record)
        self._beat = (time.monotonic(), extra) if state == "running" else None
        return record

    def heartbeat(self, step: int) -> dict[str, Any] | None:
        """Write ``running`` at ``step`` (with the extras of the last status) when
        :attr:`heartbeat_s` of wall time passed since the last status of this running
        attempt; else nothing (one clock read: cheap enough for every step). Returns the
        status written, or None."""
        if self._beat is None or time.monotonic() - self._beat[0] < self.heartbeat_s:
            return None
        return self.status("running", step, **self._beat[1])


def one_line(err: BaseException, limit: int = 300) -> str:
    """The error a status records: ``Type: message`` on one line (qkgeom's own errors
    bare), at most ``limit`` characters."""
    text = " ".join((str(err) if isinstance(err, QKGeomError)
                     else f"{type(err).__name__}: {err}").split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def record_failed(run: str | Path, message: str, steps: int | None = None, *,
                  keep: bool = True) -> dict[str, Any] | None:
    """Record ``failed`` with ``message`` for a run its trainer could not record (refused,
    or its process died). ``keep``: the step, planned ``steps`` (unless given) and time
    carry over from the status there (off for a folder not to be read: one holding a link).
    Returns the status written, or None when it could not be (a link there, a full disk)."""
    try:
        writer = RunWriter(run, Path(run).name, resume=keep)
        before = writer.previous
        writer.steps = int(before.get("steps", 0)) if steps is None else steps
        return writer.status("failed", int(before.get("step", 0)), error=message)
    except (QKGeomError, OSError):
        return None
