"""Live view of a sweep: one bar over all runs' steps, run counts per state, ETA.

It reads only the run folders (each status.json's ``step``), so it is the same for local
and Ray workers and shows runs another sweep process trains. On stderr: a rich bar on a
terminal, plain lines when redirected (:class:`PlainSweepView`: a bar would be drawn only
once, at the end).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from qkgeom.runs import FINAL_STATES

COUNTED = ("done", "running", "failed", "diverged", "locked", "pending")


def sweep_view(title: str, steps: dict[str, int]) -> SweepView | PlainSweepView:
    """The rich view when stderr is a terminal, else plain lines for a log."""
    from qkgeom.ui import console

    if console(stderr=True).is_terminal:
        return SweepView(title, steps)
    return PlainSweepView(title, steps)


def _progress(runs: dict[str, tuple[str, int]], steps: dict[str, int]
              ) -> tuple[dict[str, int], int]:
    """Runs per state, and steps completed (a finished run counts all its steps)."""
    counts = dict.fromkeys(COUNTED, 0)
    completed = 0
    for run_id, (state, step) in runs.items():
        counts[state] = counts.get(state, 0) + 1
        total = steps[run_id]
        completed += total if state in FINAL_STATES else min(step, total)
    return counts, completed


def _counts_text(counts: dict[str, int]) -> str:
    return " · ".join(f"{k} {v}" for k, v in counts.items() if v or k in ("done", "running"))


class SweepView:
    """A rich progress display; ``update`` with every run's (state, step) each poll."""

    def __init__(self, title: str, steps: dict[str, int]) -> None:
        from qkgeom.ui import progress_bar

        self._steps = steps
        self._progress = progress_bar("[bold]{task.description}", "{task.fields[counts]}",
                                      stderr=True)
        self._overall = self._progress.add_task(title, total=sum(steps.values()), counts="")
        self._per_run: dict[str, Any] = {}
        self._progress.start()

    def update(self, runs: dict[str, tuple[str, int]]) -> None:
        """``runs``: run_id -> (state, step). Finished runs count as all their steps."""
        counts, completed = _progress(runs, self._steps)
        for run_id, (state, step) in runs.items():
            total = self._steps[run_id]
            if state == "running":
                if run_id not in self._per_run:
                    self._per_run[run_id] = self._progress.add_task(
                        f"  {run_id}", total=total, completed=step, counts="")
                self._progress.update(self._per_run[run_id], completed=min(step, total))
            elif run_id in self._per_run:
                self._progress.remove_task(self._per_run.pop(run_id))
        self._progress.update(self._overall, completed=completed, counts=_counts_text(counts))

    def close(self) -> None:
        for task in self._per_run.values():
            self._progress.remove_task(task)
        self._per_run.clear()
        self._progress.stop()


class PlainSweepView:
    """Plain lines for a log, flushed at once: one when a run starts or finishes, and a
    summary (steps, share, runs per state, elapsed, ETA) every ``every`` seconds and at the
    end."""

    def __init__(self, title: str, steps: dict[str, int], every: float = 60.0,
                 stream: Any = None) -> None:
        self.title, self.every = title, every
        self.stream = stream if stream is not None else sys.stderr
        self._steps = steps
        self._total = sum(steps.values())
        self._t0 = time.perf_counter()
        self._first: int | None = None  # steps already done when the view started
        self._last_line = self._t0
        self._states: dict[str, str] = {}
        self._latest: tuple[dict[str, int], int] | None = None

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def update(self, runs: dict[str, tuple[str, int]]) -> None:
        """``runs``: run_id -> (state, step); prints what changed and, when due, a summary."""
        counts, completed = _progress(runs, self._steps)
        first = self._first is None
        if first:
            self._first = completed
        for run_id, (state, step) in runs.items():
            before = self._states.get(run_id)
            # runs finished before this sweep process started are counted, not listed
            if state != before and (state == "running" or (state in FINAL_STATES and not first)):
                where = f" at step {step}/{self._steps[run_id]}" if state != "done" else ""
                self._print(f"{self.title}: run {run_id} {state}{where}")
            self._states[run_id] = state
        self._latest = (counts, completed)
        if first or time.perf_counter() - self._last_line >= self.every:
            self._summary()

    def _summary(self) -> None:
        if self._latest is None:
            return
        from qkgeom.ui import clock

        counts, completed = self._latest
        now = time.perf_counter()
        elapsed = now - self._t0
        did = completed - (self._first or 0)
        eta = clock((self._total - completed) * elapsed / did) if did > 0 else "?"
        share = 100 * completed / max(self._total, 1)
        self._print(f"{self.title}: steps {completed}/{self._total} ({share:.0f} %)  "
                    f"{_counts_text(counts)}  elapsed {clock(elapsed)}  eta {eta}")
        self._last_line = now

    def close(self) -> None:
        self._summary()
