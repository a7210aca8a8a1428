"""`reproduce e1`, `sweep run/status` and `report` through the real CLI (subprocesses);
bad input through the same entry point in-process (exit code and one line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import in_process


def run(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkgeom.cli", *args], capture_output=True,
                          text=True, timeout=900, cwd=cwd, env={**os.environ, **env})


def fits_100_columns(text: str) -> None:
    """No cell cut to "…" and no line wider than 100 characters (a log's width)."""
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 100, text


@pytest.mark.slow
def test_reproduce_e1_smoke_then_status_and_report(sample_data: Path, tmp_path: Path) -> None:
    # A relative --out from another working directory, as a user types it.
    res = run("reproduce", "e1", "--preset", "smoke", "--data", str(sample_data), "--out",
              "sweeps/e1", "--quiet", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = tmp_path / "sweeps" / "e1"
    assert "E1.1" in res.stdout and "verdict" in res.stdout
    assert "report: sweeps/e1/report/report.md" in res.stdout
    assert "report (HTML): sweeps/e1/report/report.html" in res.stdout
    fits_100_columns(res.stdout)  # the claims table, in a log
    report = (out / "report" / "report.md").read_text()
    assert report.index("| E1.1") < report.index("## ")  # the claims table comes first
    assert "0 analysed" not in report and "6 analysed" in report
    assert (out / "report" / "report.html").is_file()
    assert (out / "report" / "pr_token.png").is_file()

    status = run("sweep", "status", "sweeps/e1", cwd=tmp_path, COLUMNS="100")
    assert status.returncode == 0 and status.stdout.count("done") >= 6
    fits_100_columns(status.stdout)
    status = run("sweep", "status", "sweeps/e1", "--format", "json", cwd=tmp_path)
    runs = json.loads(status.stdout)["runs"]
    assert [r["state"] for r in runs] == ["done"] * 6 and all(r["config_hash"] for r in runs)
    reported = run("report", "sweeps/e1", "--format", "json", cwd=tmp_path)
    doc = json.loads(reported.stdout)
    assert doc["html"] == "sweeps/e1/report/report.html"
    assert {"E1.1", "E1.2", "E2.1"} <= {c["claim_id"] for c in doc["claims"]}

    again = run("reproduce", "e1", "--preset", "smoke", "--data", str(sample_data), "--out",
                "sweeps/e1", cwd=tmp_path)  # everything is skipped
    assert again.returncode == 0 and "done 6" in again.stdout
    # its progress, in a log: the runs finished before are counted, not listed
    assert ": steps 240/240 (100 %)  done 6" in again.stderr and ": run " not in again.stderr


def test_sweep_and_report_bad_input_is_one_line_exit_2(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    grid = tmp_path / "grid.yaml"
    grid.write_text("preset: smoke\naxes:\n  model.depth: [1, 2]\n")
    code, _, err = in_process(["sweep", "run", str(grid), "--out", str(tmp_path / "s"),
                               "--quiet"], capsys)
    assert code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "depth" in err
    assert not (tmp_path / "s").exists()
    notes = tmp_path / "notes.yaml"
    notes.write_text("- just\n- a list\n")
    code, _, err = in_process(["sweep", "run", str(notes), "--quiet"], capsys)
    assert code == 2 and "mapping" in err
    code, _, err = in_process(["report", str(tmp_path / "nowhere")], capsys)
    assert code == 2 and "Traceback" not in err
    code, _, err = in_process(["reproduce", "e1", "--preset", "huge", "--out",
                               str(tmp_path / "x")], capsys)
    assert code == 2 and "preset" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()
