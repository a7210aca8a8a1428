"""`reproduce e1`, `sweep run/status` and `report` through the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


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
                "sweeps/e1", "--quiet", cwd=tmp_path)  # everything is skipped
    assert again.returncode == 0 and "done 6" in again.stdout


def test_sweep_and_report_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    grid = tmp_path / "grid.yaml"
    grid.write_text("preset: smoke\naxes:\n  model.depth: [1, 2]\n")
    res = run("sweep", "run", str(grid), "--out", str(tmp_path / "s"), "--quiet")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "depth" in res.stderr
    assert not (tmp_path / "s").exists()
    notes = tmp_path / "notes.yaml"
    notes.write_text("- just\n- a list\n")
    res = run("sweep", "run", str(notes), "--quiet")
    assert res.returncode == 2 and "mapping" in res.stderr
    res = run("report", str(tmp_path / "nowhere"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    res = run("reproduce", "e1", "--preset", "huge", "--out", str(tmp_path / "x"))
    assert res.returncode == 2 and "preset" in res.stderr and "Traceback" not in res.stderr
