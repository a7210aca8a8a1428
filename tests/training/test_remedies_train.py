"""The remedies in the trainer: a run with each trains, resumes bit for bit, records what it
promises (QK-Clip's ``qk_clip_share``; the z-term beside, never inside, the loss: in the
rows the log callbacks and sinks receive, train_log.parquet's columns being fixed)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from train_helpers import StopAt

from qkgeom import QKGeomError, make_config, train
from qkgeom.training import Callback, TrainContext
from qkgeom.training import train as train_with

STEPS, EVERY, STOP = 12, 4, 10  # checkpoints at 4, 8 (and 12); interrupted after update 10

#: The remedies, two runs: those that combine (the soft-cap's explicit path with dropout,
#: QK-Clip at a τ it meets from the first steps, the z-loss) and σReparam of every layer.
REMEDIES = {
    "softcap+qk_clip+z_loss": {"model": {"logit_softcap": 1.0, "qk_clip_threshold": 0.05,
                                         "dropout": 0.1}, "z_loss": 1e-2},
    "sigma_all": {"model": {"sigma_reparam": "all"}},
}


def config(data: Path, over: dict, **top: object):
    return make_config("smoke", {
        "data": str(data), "steps": STEPS, "checkpoint_every": EVERY, "probe_every": EVERY,
        "eval_every": EVERY, "log_every": EVERY, "warmup_steps": 2, "threads": 1,
        "keep_checkpoints": 0, **over, **top})


class LogRows(Callback):
    """The training-log rows as the callbacks (TensorBoard, W&B) receive them."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_log(self, ctx: TrainContext, row: dict[str, float]) -> None:
        self.rows.append(dict(row))

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows).set_index("step")


def same_results(ref: Path, run: Path) -> None:
    for name, cols in (("metrics.parquet", ["step", "layer", "head", "metric", "value"]),
                       ("train_log.parquet", ["step", "loss", "val_loss", "lr"])):
        pd.testing.assert_frame_equal(pd.read_parquet(ref / name)[cols],
                                      pd.read_parquet(run / name)[cols], check_exact=True)


@pytest.mark.parametrize("name", sorted(REMEDIES))
def test_a_run_with_the_remedy_learns_and_resumes_bit_for_bit(
        name: str, sample_data: Path, tmp_path: Path) -> None:
    cfg = config(sample_data, REMEDIES[name])
    rows = LogRows()
    ref = train(cfg, tmp_path / "ref", callbacks=[rows]).out_dir
    log = pd.read_parquet(ref / "train_log.parquet")
    val = log["val_loss"].dropna()
    assert val.iloc[-1] < val.iloc[0] - 0.3  # it learns
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "cut", callbacks=[StopAt(STOP)])
    train(cfg, tmp_path / "cut", resume=True)
    same_results(ref, tmp_path / "cut")
    metrics = pd.read_parquet(ref / "metrics.parquet")
    share = metrics[metrics["metric"] == "qk_clip_share"].set_index("step")["value"]
    if cfg.model.qk_clip:
        assert share.index.tolist() == [0, 4, 8, 12] and share[0] == 0.0
        assert 0 < share.max() <= 1  # QK-Clip acted, on part of the heads
        assert (rows.frame()["z_loss"].drop(0) > 0).all()
    else:
        assert share.empty and "z_loss" not in rows.frame().columns


def test_the_recorded_loss_is_the_cross_entropy_and_the_z_term_is_logged_beside_it(
        sample_data: Path, tmp_path: Path) -> None:
    """Update 1's loss (same init, same batch) is the same with and without a z-loss: the
    record is the plain cross-entropy; the z-loss changes the update, so update 2's differs."""
    over = {"steps": 2, "log_every": 1, "probe_every": 2, "eval_every": 2,
            "checkpoint_every": 2, "warmup_steps": 0}
    rows = {"plain": LogRows(), "z": LogRows()}
    for name, over_z in (("plain", {}), ("z", {"z_loss": 1.0})):
        train(config(sample_data, over_z, **over), tmp_path / name, callbacks=[rows[name]])
    plain, z = rows["plain"].frame(), rows["z"].frame()
    assert z.loc[1, "loss"] == plain.loc[1, "loss"]
    assert z.loc[2, "loss"] != plain.loc[2, "loss"]
    assert z.loc[0, "val_loss"] == plain.loc[0, "val_loss"]
    assert z.loc[1, "z_loss"] > 1.0  # (log Z)² of a near-uniform softmax over the vocabulary
    assert "z_loss" not in plain.columns
    recorded = pd.read_parquet(tmp_path / "z" / "train_log.parquet").set_index("step")
    assert recorded.loc[1, "loss"] == z.loc[1, "loss"]  # the file holds the plain loss


def test_the_bare_trainer_refuses_qk_clip_without_its_callback(sample_data: Path,
                                                                tmp_path: Path) -> None:
    cfg = config(sample_data, {"model": {"qk_clip_threshold": 100.0}})
    with pytest.raises(QKGeomError, match="enables qk_clip but no callback serves it"):
        train_with(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_resumed_run_recorded_with_the_old_key_keeps_its_hash(sample_data: Path,
                                                              tmp_path: Path) -> None:
    """A run folder written before the rename (``model.qk_reparam: sigma`` in its
    config.json) resumes under the new key: one run, one hash."""
    import json

    old = config(sample_data, {"model": {"sigma_reparam": "qk"}})
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(old, run, callbacks=[StopAt(6)])
    record = json.loads((run / "config.json").read_text())
    for key in ("sigma_reparam", "logit_softcap", "qk_clip_threshold", "qk_clip_alpha"):
        record["config"]["model"].pop(key)
    record["config"].pop("z_loss")
    record["config"]["model"]["qk_reparam"] = "sigma"
    (run / "config.json").write_text(json.dumps(record))
    with pytest.warns(FutureWarning, match="model.sigma_reparam: qk"):
        assert train(old, run, resume=True).step == STEPS
