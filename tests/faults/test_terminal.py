"""Attack group 7: terminal control sequences in text read from files. A run's error
message (ESC sequences, OSC 52 that sets the clipboard, BEL, a bidi override) and the
name of a file planted in a run folder reach the terminal escaped (``\\x1b``), never
raw; rich markup in them is shown as text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fault_helpers import group_figure, in_process, train_args, train_in_process

RESULTS: dict[str, bool] = {}
# clear screen, set the clipboard (OSC 52), ring the bell, reverse the line, rich markup
EVIL = "\x1b[2J\x1b]52;c;cm0gLXJmIH4=\x07\u202eboom[bold red]x[/bold red]\x9b31m"
RAW = ("\x1b", "\x07", "\u202e", "\x9b")


_figure = group_figure("terminal escapes", RESULTS)


def _clean(text: str) -> bool:
    return not any(c in text for c in RAW)


def test_sweep_status_escapes_a_runs_error_text(sample_data: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # the error text on one line of the table
    sweep = tmp_path / "sweep"
    run = sweep / "runs" / "r0"
    run.mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({"state": "failed", "step": 3, "steps": 8,
                                                 "error": f"worker died {EVIL}"}))
    (sweep / "sweep.json").write_text(json.dumps({
        "grid": {"name": "t", "preset": "smoke", "base": {}, "axes": {}},
        "runs": [{"run_id": "r0", "axes": {}, "config_hash": "0" * 12, "steps": 8}]}))
    code, out, err = in_process(["sweep", "status", str(sweep)], capsys)
    assert code == 0, err
    assert _clean(out + err), repr(out)
    assert "\\x1b]52;c;" in out and "[bold red]x[/bold red]" in out
    RESULTS["sweep status: ESC, OSC 52, BEL, bidi, C1 in a run's error"] = True


def test_an_error_naming_a_planted_file_is_escaped(sample_data: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = train_in_process(sample_data, tmp_path / "base", 4, 4)
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / f"notes{EVIL.replace('/', '_')}.txt").write_text("planted")
    code, _, err = in_process([*train_args(sample_data, copy, 4, 4), "--resume"], capsys)
    assert code == 2 and "holds files qkgeom did not write" in err
    assert _clean(err) and "\\x1b[2J" in err and len(err.strip().splitlines()) == 1
    RESULTS["error line naming a file called ESC…OSC 52…"] = True
