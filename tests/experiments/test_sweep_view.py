"""The sweep's progress in a log (stderr not a terminal: nohup, SLURM, CI): a line when a
run starts or finishes, a summary with steps, runs per state and ETA every ``every``
seconds and at the end; runs finished before the sweep process started are only counted."""

from __future__ import annotations

import io

from qkgeom.experiments.progress import PlainSweepView, SweepView, sweep_view


def test_plain_lines_name_each_run_as_it_starts_and_ends() -> None:
    out = io.StringIO()
    view = PlainSweepView("grid", {"a": 100, "b": 100, "c": 100}, every=3600, stream=out)
    view.update({"a": ("done", 100), "b": ("pending", 0), "c": ("pending", 0)})
    view.update({"a": ("done", 100), "b": ("running", 20), "c": ("pending", 0)})
    view.update({"a": ("done", 100), "b": ("running", 60), "c": ("running", 0)})
    view.update({"a": ("done", 100), "b": ("diverged", 61), "c": ("done", 100)})
    view.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("grid: steps 100/300 (33 %)  done 1 · running 0 · pending 2")
    assert lines[1:5] == ["grid: run b running at step 20/100", "grid: run c running at step 0/100",
                          "grid: run b diverged at step 61/100", "grid: run c done"]
    assert lines[5].startswith("grid: steps 300/300 (100 %)  done 2 · running 0 · diverged 1")
    assert len(lines) == 6  # run a (done before the view started) is counted, never listed


def test_the_summary_comes_every_interval_with_an_eta(monkeypatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("qkgeom.experiments.progress.time.perf_counter", lambda: now[0])
    out = io.StringIO()
    view = PlainSweepView("g", {"a": 400}, every=60, stream=out)
    view.update({"a": ("running", 0)})  # first update: a summary line
    now[0] += 30
    view.update({"a": ("running", 100)})  # 30 s in: not yet due
    now[0] += 30
    view.update({"a": ("running", 200)})  # 60 s, 200 of 400 steps: eta 60 s
    summaries = [ln for ln in out.getvalue().splitlines() if ": steps " in ln]
    assert len(summaries) == 2
    assert summaries[1] == "g: steps 200/400 (50 %)  done 0 · running 1  elapsed 0:01:00  eta 0:01:00"


def test_a_terminal_gets_the_rich_view_and_a_log_the_plain_one(monkeypatch) -> None:
    assert isinstance(sweep_view("g", {"a": 1}), PlainSweepView)  # pytest captures stderr
    monkeypatch.setattr("rich.console.Console.is_terminal", property(lambda self: True))
    view = sweep_view("g", {"a": 1})
    assert isinstance(view, SweepView)
    view.close()
