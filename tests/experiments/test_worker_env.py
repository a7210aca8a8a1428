"""Worker processes do not import from the folder a sweep was started in: a user's
``json.py`` there (any module named like one of the standard library's) would otherwise
shadow the real one in every ``python -m qkgeom.experiments worker`` and fail every run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sweep_helpers import tiny_grid, write_grid

from qkgeom.runs import read_status
from qkgeom.runs.sweep import run_dir


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH needs Python 3.11")
def test_a_module_in_the_working_folder_does_not_reach_the_workers(sample_data: Path,
                                                                   tmp_path: Path) -> None:
    (tmp_path / "json.py").write_text("raise ImportError('the user folder was imported')\n")
    write_grid(tmp_path / "grid.yaml", tiny_grid(sample_data, steps=10, seeds=[0], warmup_steps=2))
    qkgeom = Path(sys.executable).parent / "qkgeom"  # the console script, as a user runs it
    res = subprocess.run([str(qkgeom), "sweep", "run", "grid.yaml", "--out", "sweep",
                          "--workers", "1", "--threads", "1", "--quiet"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert read_status(run_dir(tmp_path / "sweep", "seed=0"))["state"] == "done"
