"""SIGKILL `qkgeom analyze` part-way through a checkpoint family: the rerun reuses what was
cached, analyses the rest, and ends with the same table as an uninterrupted analysis.

The kill is an event, not a moment: ``QKGEOM_FAULT=kill:ckpt_*.json:N`` SIGKILLs the
analysis half-way through writing the N-th checkpoint's "done" marker, so exactly N − 1
checkpoints are cached and the N-th has its table but no marker (unfinished)."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pandas as pd
import pytest
from fault_helpers import cli, figure, train_in_process

STEPS, EVERY = 24, 4  # checkpoints at 4, 8, ..., 24: six "revisions" of one run


def _analyze(run: Path, out: Path) -> list[str]:
    revisions = ",".join(str(s) for s in range(EVERY, STEPS + 1, EVERY))
    return ["analyze", str(run), "--revisions", revisions, "--text", "sample",
            "--tokens", "1024", "--out", str(out), "--quiet"]


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
    for nth in (1, 3, 5):  # killed while marking the nth checkpoint done
        shutil.rmtree(out, ignore_errors=True)
        killed = cli(*_analyze(run, out), fault=f"kill:ckpt_*.json:{nth}")
        assert killed.returncode == -signal.SIGKILL, killed.stderr  # the kill landed
        before = _cached(out)
        assert len(before) == nth - 1  # exactly the checkpoints marked before it
        torn = out / "checkpoints" / f"ckpt_{nth * EVERY:08d}"
        assert torn.with_suffix(".parquet").is_file() and not torn.with_suffix(".json").exists()
        rerun = cli(*_analyze(run, out))
        assert rerun.returncode == 0, rerun.stderr
        after = _cached(out)
        # every result cached before the kill was reused, not recomputed
        assert all(after.get(name) == mtime for name, mtime in before.items()), (nth, after)
        assert len(after) == STEPS // EVERY
        cols = ["checkpoint", "step", "layer", "head", "metric", "value"]
        a = pd.read_parquet(ref / "metrics.parquet")[cols].sort_values(cols[:5])
        b = pd.read_parquet(out / "metrics.parquet")[cols].sort_values(cols[:5])
        pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True),
                                      check_exact=True)
        survived += 1
    figure("analyze kills", f"kills survived {survived}/3 (cache reused, table identical)")
