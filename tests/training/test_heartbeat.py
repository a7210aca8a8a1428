"""A sign of life between probes: ``status.json`` says the step a live run reached at least
every ``HEARTBEAT_S`` of wall time (the trainer and the monitor), and a log gets a plain
progress line as often, whatever the probe cadence. No timing in the tests: the interval is
set to 0 (every step is due) or a test clock is moved by hand. The monitor's:
tests/monitor/test_monitor_resume.py."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from qkgeom.training import Callback, TrainContext


class ReadStatus(Callback):
    """The step ``status.json`` says, read after each update (before the trainer's own
    writes of that step)."""

    def __init__(self, out: Path) -> None:
        self.out, self.seen = out, []

    def on_step_end(self, ctx: TrainContext) -> None:
        status = json.loads((self.out / "status.json").read_text())
        self.seen.append((ctx.step, status["state"], status["step"]))


def test_status_says_the_step_reached_between_probes(sample_data: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Probes at 0, 4, 8; with the interval at 0 every update's status is written (a
    trainer without the heartbeat says 0 until step 4)."""
    import qkgeom.runs.writer as writer
    from qkgeom import make_config
    from qkgeom.training import train

    monkeypatch.setattr(writer, "HEARTBEAT_S", 0.0)  # every step is past the interval
    cfg = make_config("smoke", {"data": str(sample_data), "steps": 8, "probe_every": 4,
                                "eval_every": 8, "checkpoint_every": 8, "log_every": 4})
    spy = ReadStatus(tmp_path / "beat")
    train(cfg, tmp_path / "beat", callbacks=[spy])
    # after update s the status says s - 1: the heartbeat of the step before
    assert spy.seen == [(s, "running", s - 1) for s in range(1, 9)]


def test_a_heartbeat_keeps_the_extras_and_never_follows_a_final_state(tmp_path: Path) -> None:
    from qkgeom.runs import RunWriter, read_status

    run = RunWriter(tmp_path, "r", steps=100, heartbeat_s=0.0)
    assert run.heartbeat(1) is None  # no running status yet: nothing to keep alive
    run.status("running", 10, probe_s=1.5)
    assert run.heartbeat(17)["step"] == 17
    status = read_status(tmp_path)
    assert (status["state"], status["step"], status["probe_s"]) == ("running", 17, 1.5)
    run.status("done", 100)
    assert run.heartbeat(100) is None and read_status(tmp_path)["state"] == "done"
    slow = RunWriter(tmp_path, "r", steps=100, heartbeat_s=3600.0)
    slow.status("running", 5)
    assert slow.heartbeat(6) is None and read_status(tmp_path)["step"] == 5


def test_the_plain_progress_line_comes_at_least_every_heartbeat() -> None:
    from qkgeom.ui import PlainSteps

    now = [0.0]
    out = io.StringIO()
    bar = PlainSteps("train", 400, 0, 100, stream=out, heartbeat_s=30.0, clock=lambda: now[0])
    for _ in range(3):  # 3 steps, 9 s each: under the heartbeat, before the cadence
        now[0] += 9.0
        bar.advance()
    assert out.getvalue() == ""
    now[0] += 3.5  # step 4 at 30.5 s: a line saying where the run is
    bar.advance()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train step 4/400 (1 %)"), lines
    assert "elapsed 0:00:30" in lines[0]
    now[0] += 29.0  # under the heartbeat again since that line
    bar.advance()
    assert len(out.getvalue().splitlines()) == 1

