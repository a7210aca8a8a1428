"""The tables and status of a run folder while a run writes them (trainer or monitor).

Every write is atomic (:mod:`qkgeom.io`), so a run killed at any moment leaves the last
complete ``metrics.parquet`` / ``train_log.parquet`` / ``status.json`` behind. The status
records when the run started and the wall time spent on it, summed over resumed attempts.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pandas as pd

from qkgeom.errors import QKGeomError
from qkgeom.io import read_json, write_json, write_parquet
from qkgeom.runs.folder import (
    LOG_COLUMNS,
    METRIC_COLUMNS,
    METRICS,
    STATUS,
    TRAIN_LOG,
    read_log,
    read_metrics,
)


class RunWriter:
    """Accumulates a run's metrics and log rows and writes them, with its status, to ``out``.

    Args:
        out: the run folder (its config.json is written by the caller).
        run_id: the ``run_id`` column of the metrics.
        steps: the run's planned length, recorded in the status.
        resume: continue an earlier attempt: its start time and wall time carry over.
    """

    def __init__(self, out: str | Path, run_id: str, *, steps: int = 0,
                 resume: bool = False) -> None:
        self.out, self.run_id, self.steps = Path(out), run_id, steps
        self._metrics: list[pd.DataFrame] = []
        self._log: list[dict[str, float]] = []
        prev: dict[str, Any] = {}
        if resume and (self.out / STATUS).exists():
            with contextlib.suppress(QKGeomError):
                prev = read_json(self.out / STATUS)
        prev = prev if isinstance(prev, dict) else {}  # a garbage status is rewritten
        number = (int, float)
        started, wall = prev.get("started"), prev.get("wall_s")
        self.started = started if isinstance(started, number) else time.time()
        self._wall_before = float(wall) if isinstance(wall, number) else 0.0
        self._t0 = time.perf_counter()

    def restore(self, upto: int | None = None) -> None:
        """Take up the tables an earlier attempt wrote (rows with ``step <= upto``)."""
        metrics = read_metrics(self.out, upto)
        log = read_log(self.out, upto)
        self._metrics = [metrics] if metrics is not None else []
        self._log = log.to_dict("records") if log is not None else []

    def add_metrics(self, frame: pd.DataFrame, step: int, *, replace: bool = False) -> None:
        """Append long-format rows of one probe at ``step`` (``replace``: drop earlier rows of
        that step first). ``run_id`` and ``step`` columns are set here."""
        rows = frame.assign(run_id=self.run_id, step=int(step))[METRIC_COLUMNS]
        if replace:
            self._metrics = [m[m["step"] != step] for m in self._metrics]
        self._metrics.append(rows)

    def add_log(self, row: dict[str, float]) -> None:
        """One ``train_log`` row (missing columns are NaN)."""
        self._log.append({c: float(row.get(c, float("nan"))) for c in LOG_COLUMNS})

    @property
    def metrics(self) -> pd.DataFrame:
        if not self._metrics:
            return pd.DataFrame(columns=METRIC_COLUMNS)
        return pd.concat(self._metrics, ignore_index=True)

    @property
    def log(self) -> pd.DataFrame:
        frame = pd.DataFrame(self._log, columns=LOG_COLUMNS)
        return frame.astype({"step": "int64"}) if len(frame) else frame

    def flush(self) -> None:
        """Write the metrics and the log (those that have rows), atomically."""
        if self._metrics:
            write_parquet(self.out / METRICS, self.metrics)
        if self._log:
            write_parquet(self.out / TRAIN_LOG, self.log)

    def status(self, state: str, step: int, **extra: Any) -> None:
        """Write ``status.json``: state, step, planned steps, start and wall time, extras."""
        write_json(self.out / STATUS, {
            "state": state, "step": int(step), "steps": max(self.steps, int(step)),
            "started": self.started, "updated": time.time(),
            "wall_s": self._wall_before + time.perf_counter() - self._t0, **extra})
