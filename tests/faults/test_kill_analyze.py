"""SIGKILL `qkgeom analyze` part-way through a checkpoint family: the rerun reuses what was
cached, analyses the rest, and ends with the same table as an uninterrupted analysis."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pandas as pd
import pytest
from fault_helpers import cli, figure, popen, train_in_process

STEPS, EVERY = 24, 4  # checkpoints at 4, 8, ..., 24: six "revisions" of one run


def _analyze(run: Path, out: Path) -> list[str]:
    revisions = ",".join(str(s) for s in range(EVERY, STEPS + 1, EVERY))
    return ["analyze", str(run), "--revisions", revisions, "--text", "sample",
            "--tokens", "3000", "--out", str(out), "--quiet"]


def _cached(out: Path) -> dict[str, int]:
    """Finished cache entries (a result and its ``.json`` marker) and their mtimes; a result
    whose marker was not written yet is unfinished and is recomputed."""
    folder = out / "checkpoints"
    if not folder.is_dir():
        return {}
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("*.parquet")
            if p.with_suffix(".json").is_file()}


@pytest.mark.slow
def test_analyze_killed_three_times_reuses_its_cache_and_matches(sample_data: Path,
                                                                 tmp_path: Path) -> None:
    run = train_in_process(sample_data, tmp_path / "run", STEPS, EVERY, keep_checkpoints=10)
    ref = tmp_path / "ref"
    done = cli(*_analyze(run, ref))
    assert done.returncode == 0, done.stderr
    out = tmp_path / "killed"
    survived = 0
    for target in (1, 3, 5):  # kill once this many checkpoints are cached
        shutil.rmtree(out, ignore_errors=True)
        proc = popen(*_analyze(run, out))
        deadline = time.monotonic() + 240
        while len(_cached(out)) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        before = _cached(out)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rerun = cli(*_analyze(run, out))
        assert rerun.returncode == 0, rerun.stderr
        after = _cached(out)
        # every result cached before the kill was reused, not recomputed
        reused = all(after.get(name) == mtime for name, mtime in before.items())
        cols = ["checkpoint", "step", "layer", "head", "metric", "value"]
        a = pd.read_parquet(ref / "metrics.parquet")[cols].sort_values(cols[:5])
        b = pd.read_parquet(out / "metrics.parquet")[cols].sort_values(cols[:5])
        same = a.reset_index(drop=True).equals(b.reset_index(drop=True))
        survived += int(reused and same)
        assert reused and same, (target, before, after)
    figure("analyze kills", f"kills survived {survived}/3 (cache reused, table identical)")
