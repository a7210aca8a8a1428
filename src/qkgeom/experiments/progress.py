"""Live view of a sweep: one bar over all runs' steps, run counts per state, ETA.

The view learns everything from the run folders (each run's status.json ``step``, written
at every probe and checkpoint boundary), so it looks the same for local and Ray workers and
shows runs that another sweep process trains on the same folder. Drawn on stderr.
"""

from __future__ import annotations

from typing import Any

COUNTED = ("done", "running", "failed", "diverged", "locked", "pending")


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
        counts = dict.fromkeys(COUNTED, 0)
        completed = 0
        for run_id, (state, step) in runs.items():
            counts[state] = counts.get(state, 0) + 1
            total = self._steps[run_id]
            completed += total if state in ("done", "failed", "diverged") else min(step, total)
            if state == "running":
                if run_id not in self._per_run:
                    self._per_run[run_id] = self._progress.add_task(
                        f"  {run_id}", total=total, completed=step, counts="")
                self._progress.update(self._per_run[run_id], completed=min(step, total))
            elif run_id in self._per_run:
                self._progress.remove_task(self._per_run.pop(run_id))
        text = " · ".join(f"{k} {v}" for k, v in counts.items() if v or k in ("done", "running"))
        self._progress.update(self._overall, completed=completed, counts=text)

    def close(self) -> None:
        for task in self._per_run.values():
            self._progress.remove_task(task)
        self._per_run.clear()
        self._progress.stop()
