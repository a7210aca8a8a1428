"""The checkpoint schedule: ``every`` (multiples of checkpoint_every) and ``log`` (step 0,
the powers of two below checkpoint_every, then its multiples), keep_checkpoints = 0 keeps
all, and a log-schedule run interrupted mid-way resumes bit for bit."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from qkgeom import QKGeomError, make_config
from qkgeom.runs import list_checkpoints
from qkgeom.training import Callback, TrainContext, train
from qkgeom.training.checkpoint import checkpoint_steps, is_checkpoint_step

COLS = ["step", "layer", "head", "metric", "value"]


def test_schedules_by_hand() -> None:
    assert checkpoint_steps(40, 16, "log") == [0, 1, 2, 4, 8, 16, 32, 40]
    assert checkpoint_steps(40, 16, "every") == [16, 32, 40]
    assert checkpoint_steps(300, 100, "log") == [0, 1, 2, 4, 8, 16, 32, 64, 100, 200, 300]
    assert checkpoint_steps(64, 64, "log") == [0, 1, 2, 4, 8, 16, 32, 64]
    assert not is_checkpoint_step(0, 10, "every") and is_checkpoint_step(0, 10, "log")
    assert not is_checkpoint_step(3, 10, "log") and not is_checkpoint_step(12, 10, "log")
    with pytest.raises(QKGeomError, match="checkpoint_schedule"):
        make_config("smoke", {"checkpoint_schedule": "sqrt"})
    with pytest.raises(QKGeomError, match="keep_checkpoints"):
        make_config("smoke", {"keep_checkpoints": -1})


def _stop_after(step: int) -> Callback:
    """A callback interrupting the run after update ``step`` (a kill between checkpoints)."""

    class Stop(Callback):
        def on_step_end(self, ctx: TrainContext) -> None:
            if ctx.step == step:
                raise KeyboardInterrupt

    return Stop()


@pytest.mark.slow
def test_a_log_schedule_run_resumed_mid_way_is_bit_exact(sample_data: Path,
                                                         tmp_path: Path) -> None:
    cfg = make_config("smoke", {"data": str(sample_data), "steps": 40, "probe_every": 10,
                                "checkpoint_every": 16, "checkpoint_schedule": "log",
                                "keep_checkpoints": 0, "threads": 1})
    want = [0, 1, 2, 4, 8, 16, 32, 40]
    ref = train(cfg, tmp_path / "ref")
    assert [s for s, _ in list_checkpoints(ref.out_dir)] == want  # keep 0: all of them
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out, callbacks=[_stop_after(11)])  # after the step-8 checkpoint
    assert [s for s, _ in list_checkpoints(out)] == [0, 1, 2, 4, 8]
    res = train(cfg, out, resume=True)
    assert res.status == "done" and [s for s, _ in list_checkpoints(out)] == want
    pd.testing.assert_frame_equal(pd.read_parquet(ref.out_dir / "metrics.parquet")[COLS],
                                  pd.read_parquet(out / "metrics.parquet")[COLS],
                                  check_exact=True)
    cols = ["step", "loss", "val_loss", "lr"]
    pd.testing.assert_frame_equal(pd.read_parquet(ref.out_dir / "train_log.parquet")[cols],
                                  pd.read_parquet(out / "train_log.parquet")[cols],
                                  check_exact=True)
    # and a run cut right after its step-0 checkpoint (new with the log schedule)
    zero = tmp_path / "zero"
    with pytest.raises(KeyboardInterrupt):
        train(cfg, zero, callbacks=[_stop_after(1)])
    assert [s for s, _ in list_checkpoints(zero)] == [0]
    train(cfg, zero, resume=True)
    pd.testing.assert_frame_equal(pd.read_parquet(ref.out_dir / "metrics.parquet")[COLS],
                                  pd.read_parquet(zero / "metrics.parquet")[COLS],
                                  check_exact=True)
