"""Real sweep processes: SIGKILL mid-sweep then rerun, and two sweeps on one folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
from sweep_helpers import attempts, metrics, mtimes, sweep_cmd, tiny_grid, write_grid

from qkgeom.experiments import run_sweep, sweep_status
from qkgeom.runs import lock_is_held, read_status
from qkgeom.runs.sweep import run_dir

LOG_COLS = ["step", "loss", "val_loss", "lr"]


def _wait_for(condition, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"sweep exited early: {proc.stderr.read() if proc.stderr else ''}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the sweep")
        time.sleep(0.02)


@pytest.mark.slow
def test_sigkill_mid_sweep_then_rerun_resumes_exactly(sample_data: Path,
                                                      tmp_path: Path) -> None:
    grid = tiny_grid(sample_data, name="kill", steps=100, seeds=[0, 1, 2])
    grid_file = write_grid(tmp_path / "kill.yaml", grid)
    out = tmp_path / "sweep"
    first, second, third = (run_dir(out, r) for r in ("seed=0", "seed=1", "seed=2"))
    proc = subprocess.Popen(sweep_cmd(grid_file, out), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # Kill once the first run is done and the second is mid-run with records behind it.
        _wait_for(lambda: (read_status(first) or {}).get("state") == "done"
                  and (second / "checkpoints" / "ckpt_00000020.pt").exists(), 240, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its worker, like a pre-emption
        proc.wait()
    _wait_for(lambda: not lock_is_held(second), 30)  # the kernel drops a dead worker's lock
    status = read_status(second)
    assert status is not None and status["state"] == "running" and status["step"] < 100
    table = sweep_status(out).set_index("run_id")["state"].to_dict()
    assert table == {"seed=0": "done", "seed=1": "interrupted", "seed=2": "pending"}
    first_files = mtimes(first)

    summary = run_sweep(grid, out, workers=1, threads_per_run=1, progress=False)
    assert summary.counts["done"] == 3 and summary.trained == ["seed=1", "seed=2"]
    assert mtimes(first) == first_files  # the finished run was not touched
    assert len(attempts(first)) == 1 and len(attempts(third)) == 1
    resumed = attempts(second)
    assert len(resumed) == 2 and resumed[0]["resume_from"] is None
    assert resumed[1]["resume_from"] >= 20

    # The resumed run equals an uninterrupted one bit for bit (CPU, same seed, 1 thread).
    ref_out = tmp_path / "reference"
    run_sweep(tiny_grid(sample_data, name="ref", steps=100, seeds=[1]), ref_out, workers=1,
              threads_per_run=1, progress=False)
    ref = run_dir(ref_out, "seed=1")
    pd.testing.assert_frame_equal(metrics(ref), metrics(second), check_exact=True)
    pd.testing.assert_frame_equal(pd.read_parquet(ref / "train_log.parquet")[LOG_COLS],
                                  pd.read_parquet(second / "train_log.parquet")[LOG_COLS],
                                  check_exact=True)


@pytest.mark.slow
def test_two_sweep_processes_never_train_a_run_twice(sample_data: Path,
                                                     tmp_path: Path) -> None:
    grid = tiny_grid(sample_data, name="pair", steps=20, seeds=[0, 1, 2, 3])
    grid_file = write_grid(tmp_path / "pair.yaml", grid)
    out = tmp_path / "sweep"
    procs = [subprocess.Popen(sweep_cmd(grid_file, out), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (stdout, stderr) in zip(procs, results, strict=True):
        assert proc.returncode == 0, stderr
        assert stdout.startswith(f"sweep {out}:")  # each ends on its own, nothing left to do
    for spec in grid.expand():
        run = run_dir(out, spec.run_id)
        assert read_status(run)["state"] == "done"
        assert len(attempts(run)) == 1, spec.run_id  # trained exactly once
        assert len({a["pid"] for a in attempts(run)}) == 1
        log = pd.read_parquet(run / "train_log.parquet")
        assert log["step"].is_unique
        assert json.loads((run / "config.json").read_text())["run_id"] == spec.run_id
