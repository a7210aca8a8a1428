"""The trainer on the real embedded Wikipedia sample: learning, records, determinism."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from qkgeom import DivergedError, QKGeomError, make_config, train
from qkgeom.training import Callback, TrainContext

METRICS = {"pr_q_weight", "pr_k_weight", "contrast_weight", "pr_qk_weight", "pr_qk_weight_full",
           "pr_q_token", "pr_k_token", "contrast_token", "contrast_token_heads", "pr_qk_token",
           "logit_std", "attn_entropy", "attn_entropy_norm", "attn_max",
           "attn_entropy_scalefree", "logit_std_row", "logit_max", "logit_delta", "sink_mass",
           "entropy_min", "q_norm_max", "k_norm_max", "logit_bound"}


def smoke(data: Path, **over: object) -> object:
    return make_config("smoke", {"data": str(data), **over})


def test_smoke_run_learns_and_writes_the_run_folder(sample_data: Path, tmp_path: Path) -> None:
    cfg = smoke(sample_data, steps=60, probe_every=20)
    res = train(cfg, tmp_path / "run")
    out = res.out_dir
    for name in ("config.json", "metrics.parquet", "train_log.parquet", "status.json"):
        assert (out / name).is_file(), name
    assert list((out / "checkpoints").glob("ckpt_*.pt"))
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "done" and status["step"] == 60

    log = pd.read_parquet(out / "train_log.parquet")
    assert list(log.columns) == ["step", "loss", "val_loss", "lr", "tokens_per_s"]
    val = log.dropna(subset=["val_loss"])
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    first, last = val["val_loss"].iloc[0], val["val_loss"].iloc[-1]
    assert first == pytest.approx(math.log(vocab), abs=0.5)  # starts near uniform
    assert last < first - 0.8  # and learns

    m = pd.read_parquet(out / "metrics.parquet")
    assert list(m.columns) == ["run_id", "step", "layer", "head", "metric", "value"]
    assert sorted(m["step"].unique()) == [0, 20, 40, 60]
    assert set(m["metric"]) == METRICS
    assert set(m["head"]) == {-1, 0, 1} and set(m["layer"]) == {0, 1}
    assert m["value"].notna().all()
    assert (m["run_id"] == "run").all()


def test_same_seed_same_metrics_other_seed_differs(sample_data: Path, tmp_path: Path) -> None:
    a = train(smoke(sample_data, steps=20), tmp_path / "a").metrics
    b = train(smoke(sample_data, steps=20), tmp_path / "b").metrics
    c = train(smoke(sample_data, steps=20, seed=1), tmp_path / "c").metrics
    cols = ["step", "layer", "head", "metric", "value"]
    pd.testing.assert_frame_equal(a[cols], b[cols], check_exact=True)
    assert not a["value"].equals(c["value"])


def test_tied_init_has_zero_weight_contrast_at_step_0(sample_data: Path, tmp_path: Path) -> None:
    m = train(smoke(sample_data, steps=20, model={"qk_init": "tied"}), tmp_path / "t").metrics
    at0 = m[(m["step"] == 0) & (m["metric"] == "contrast_weight")]
    assert (at0["value"] == 0.0).all()
    later = m[(m["step"] == 20) & (m["metric"] == "contrast_weight")]
    assert (later["value"] != 0.0).any()  # trained separately afterwards


class _Poison(Callback):
    """Writes NaN into a weight after a given step, to check divergence detection."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, ctx: TrainContext) -> None:
        if ctx.step == self.at:
            with torch.no_grad():
                ctx.model.blocks[0].attn.q_proj.weight.fill_(float("nan"))


def test_nan_is_recorded_as_diverged_at_the_right_step(sample_data: Path, tmp_path: Path) -> None:
    with pytest.raises(DivergedError, match="step 8"):
        train(smoke(sample_data), tmp_path / "d", callbacks=[_Poison(at=7)])
    status = json.loads((tmp_path / "d" / "status.json").read_text())
    assert status["state"] == "diverged" and status["diverged_step"] == 8
    # What was measured before the divergence is kept.
    assert 0 in set(pd.read_parquet(tmp_path / "d" / "metrics.parquet")["step"])


def test_existing_run_folder_is_not_clobbered(sample_data: Path, tmp_path: Path) -> None:
    train(smoke(sample_data, steps=10, probe_every=5), tmp_path / "r")
    with pytest.raises(QKGeomError, match="--resume"):
        train(smoke(sample_data, steps=10, probe_every=5), tmp_path / "r")
    with pytest.raises(QKGeomError, match="different config"):
        train(smoke(sample_data, steps=10, probe_every=5, seed=3), tmp_path / "r", resume=True)


def test_split_shorter_than_a_block_is_a_clear_error(sample_data: Path, tmp_path: Path) -> None:
    with pytest.raises(QKGeomError, match="block"):
        train(smoke(sample_data, model={"block_size": 10_000_000}), tmp_path / "big")
    assert not (tmp_path / "big").exists()  # validated before anything was written


def test_a_config_built_in_python_with_int_betas_trains(sample_data: Path,
                                                        tmp_path: Path) -> None:
    """beta1 = 0 is a valid Adam setting; a config built in Python may hold it as an int,
    which torch's AdamW refuses beside a float beta2 (found by the API fuzz test)."""
    import dataclasses

    cfg = dataclasses.replace(smoke(sample_data, steps=2, probe_every=2, warmup_steps=1),
                              beta1=0)
    assert train(cfg, tmp_path / "r").step == 2
