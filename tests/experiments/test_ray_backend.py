"""The Ray backend against a real local Ray head (tests/ray_cluster.py): same runs, same
metrics as local."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from sweep_helpers import attempts, metrics, tiny_grid, write_grid

from qkgeom.runs import read_status
from qkgeom.runs.sweep import WORKER_LOG, run_dir

pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'qkgeom[ray]')")

from ray_cluster import LOOPBACK_ENV  # noqa: E402
from ray_cluster import ray_head as _ray_head  # noqa: E402


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    with _ray_head() as address:
        yield address


@pytest.mark.slow
def test_ray_backend_matches_the_local_backend(ray_head: str, local_tiny_sweep,
                                               sample_data: Path, tmp_path: Path) -> None:
    local_out, _ = local_tiny_sweep
    grid_file = write_grid(tmp_path / "tiny.yaml", tiny_grid(sample_data))
    out = tmp_path / "ray-sweep"
    env = dict(os.environ, **LOOPBACK_ENV)
    res = subprocess.run([sys.executable, "-m", "qkgeom.cli", "sweep", "run", str(grid_file),
                          "--out", str(out), "--backend", "ray", "--address", ray_head,
                          "--workers", "2", "--threads", "1", "--quiet"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "done 2" in res.stdout
    for run_id in ("seed=0", "seed=1"):
        run = run_dir(out, run_id)
        assert read_status(run)["state"] == "done"
        assert len(attempts(run)) == 1 and (run / WORKER_LOG).exists()
        pd.testing.assert_frame_equal(metrics(run_dir(local_out, run_id)), metrics(run),
                                      check_exact=True)
    # Rerun through Ray: nothing left to do, nothing retrained.
    again = subprocess.run([sys.executable, "-m", "qkgeom.cli", "sweep", "run", str(grid_file),
                            "--out", str(out), "--backend", "ray", "--address", ray_head,
                            "--quiet"], capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0, again.stderr
    assert all(len(attempts(run_dir(out, r))) == 1 for r in ("seed=0", "seed=1"))

