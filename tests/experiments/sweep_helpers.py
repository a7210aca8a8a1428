"""Helpers for sweep tests: tiny real grids, run-folder readers, the module's CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from qkgeom.experiments import Grid

METRIC_COLS = ["run_id", "step", "layer", "head", "metric", "value"]


def tiny_grid(data: Path, *, name: str = "tiny", steps: int = 20, seeds: list[int] | None = None,
              **base: Any) -> Grid:
    """A smoke-model grid over seeds: ~2 s of training per run."""
    return Grid.from_dict({
        "name": name, "preset": "smoke",
        "base": {"data": str(data), "steps": steps, "probe_every": 10, "checkpoint_every": 10,
                 "eval_every": 10, **base},
        "axes": {"seed": seeds if seeds is not None else [0, 1]},
    })


def metrics(run: Path) -> pd.DataFrame:
    return pd.read_parquet(run / "metrics.parquet")[METRIC_COLS]


def attempts(run: Path) -> list[dict[str, Any]]:
    path = run / "attempts.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mtimes(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` with its mtime in ns (lock files excluded)."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns
            for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix != ".lock"}


def write_grid(path: Path, grid: Grid) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(grid.to_dict(), sort_keys=False))
    return path


def sweep_cmd(grid_file: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "qkgeom.cli", "sweep", "run", str(grid_file), "--out",
            str(out), "--workers", "1", "--threads", "1", "--quiet", *extra]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qkgeom.cli", "sweep", *args],
                          capture_output=True, text=True, timeout=timeout)
