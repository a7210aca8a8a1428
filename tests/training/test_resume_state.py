"""Resume restores everything a run's next steps depend on, from the newest intact
checkpoint: with dropout on (torch's global RNG drives it) a resumed run equals an
uninterrupted one bit for bit, and it started where the newest checkpoint says, not at an
older one that happens to give the same numbers; with the newest checkpoint torn it falls
back to the one before."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pandas as pd
import pytest
from train_helpers import StopAt

from qkgeom import make_config, train
from qkgeom.training import Callback, TrainContext
from qkgeom.training.checkpoint import list_checkpoints

STEPS, EVERY, STOP = 12, 4, 10  # checkpoints at 4, 8 (and 12); interrupted after update 10


def config(data: Path):
    return make_config("smoke", {
        "data": str(data), "steps": STEPS, "checkpoint_every": EVERY, "probe_every": EVERY,
        "eval_every": EVERY, "log_every": EVERY, "warmup_steps": 2, "threads": 1,
        "keep_checkpoints": 0, "model": {"dropout": 0.1}})


class _StartStep(Callback):
    """Records the step a (resumed) run starts training from."""

    def __init__(self) -> None:
        self.started: int | None = None

    def on_train_start(self, ctx: TrainContext) -> None:
        self.started = ctx.step


def assert_same_results(ref: Path, run: Path) -> None:
    """Bit-for-bit equal metrics and train log (timings aside)."""
    for name, cols in (("metrics.parquet", ["step", "layer", "head", "metric", "value"]),
                       ("train_log.parquet", ["step", "loss", "val_loss", "lr"])):
        pd.testing.assert_frame_equal(pd.read_parquet(ref / name)[cols],
                                      pd.read_parquet(run / name)[cols], check_exact=True)


def _files(run: Path) -> dict[str, tuple[int, int]]:
    """Each checkpoint file with its inode and mtime: a rewritten one changes."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for _, p in list_checkpoints(run)}


@pytest.fixture(scope="module")
def runs(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted reference and a copy of the run interrupted after update 10."""
    root = tmp_path_factory.mktemp("resume")
    ref = train(config(sample_data), root / "ref").out_dir
    cut = root / "cut"
    with pytest.raises(KeyboardInterrupt):
        train(config(sample_data), cut, callbacks=[StopAt(STOP)])
    assert [s for s, _ in list_checkpoints(cut)] == [4, 8]
    return {"ref": ref, "cut": cut}


def test_dropout_is_really_on(runs: dict[str, Path], sample_data: Path, tmp_path: Path) -> None:
    """The reference's numbers depend on dropout: without it they differ (so a resume that
    lost the dropout RNG state could not reproduce them by accident)."""
    import dataclasses

    cfg = config(sample_data)
    off = train(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.0)),
                tmp_path / "off").log
    on = pd.read_parquet(runs["ref"] / "train_log.parquet")
    assert not off["loss"].dropna().equals(on["loss"].dropna())


def test_resume_with_dropout_is_bit_exact_from_the_newest_checkpoint(
        runs: dict[str, Path], sample_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["cut"], run)
    kept = _files(run)
    start = _StartStep()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the newest checkpoint is intact: no fallback
        train(config(sample_data), run, resume=True, callbacks=[start])
    assert start.started == 8  # the newest, not an older checkpoint
    after = _files(run)
    assert {n: after[n] for n in kept} == kept  # checkpoints 4 and 8 were not rewritten
    assert sorted(after) == ["ckpt_00000004.pt", "ckpt_00000008.pt", "ckpt_00000012.pt"]
    assert_same_results(runs["ref"], run)


def test_a_torn_newest_checkpoint_falls_back_to_the_previous_one(
        runs: dict[str, Path], sample_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["cut"], run)
    newest = run / "checkpoints" / "ckpt_00000008.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a torn write
    oldest = _files(run)["ckpt_00000004.pt"]
    start = _StartStep()
    with pytest.warns(UserWarning, match="ckpt_00000008.pt: unreadable checkpoint"):
        train(config(sample_data), run, resume=True, callbacks=[start])
    assert start.started == 4
    assert _files(run)["ckpt_00000004.pt"] == oldest
    assert_same_results(runs["ref"], run)
