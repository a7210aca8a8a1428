"""KeyControlCallback inside the real trainer on the embedded sample (smoke size)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from qkgeom import make_config, train
from qkgeom.config import KeyControlConfig
from qkgeom.control import KeyControlCallback
from qkgeom.training import Callback, TrainContext
from qkgeom.training import train as train_with_callbacks

COLS = ["step", "layer", "head", "metric", "value"]


def smoke(data: Path, **over: object):
    return make_config("smoke", {"data": str(data), "steps": 40, "probe_every": 10,
                                 "checkpoint_every": 20, "threads": 1, **over})


class _Stop(Callback):
    """Interrupts the run after a given step (a checkpoint exists at 20)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, ctx: TrainContext) -> None:
        if ctx.step == self.at:
            raise KeyboardInterrupt


def test_hold_in_the_trainer_records_targets_and_resumes_bit_for_bit(sample_data: Path,
                                                                     tmp_path: Path) -> None:
    hold = {"key_control": {"mode": "hold"}}
    res = train(smoke(sample_data, **hold), tmp_path / "ref")
    m = res.metrics
    ctl = m[m["metric"].str.startswith("ctl_")]
    assert set(ctl["step"]) == {0, 10, 20, 30, 40}
    assert (ctl["layer"] == -1).all() and (ctl["head"] == -1).all()
    # the probe's own pr_k_weight (whole layer) sits on the hold target at every probe step
    for layer in (0, 1):
        target = ctl[ctl["metric"] == f"ctl_target_l{layer}"].set_index("step")["value"]
        probed = m[(m["metric"] == "pr_k_weight") & (m["layer"] == layer)
                   & (m["head"] == -1)].set_index("step")["value"]
        assert (target == target.iloc[0]).all()  # hold: PR0 throughout
        assert ((probed - target).abs() / target).max() < 1e-3

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        train(smoke(sample_data, **hold), out, callbacks=[_Stop(25)])
    again = train(smoke(sample_data, **hold), out, resume=True)
    a = m.sort_values(COLS[:4]).reset_index(drop=True)[COLS]
    b = pd.read_parquet(out / "metrics.parquet").sort_values(COLS[:4]).reset_index(drop=True)[COLS]
    assert again.step == 40
    pd.testing.assert_frame_equal(a, b, check_exact=True)


def test_mode_none_in_the_trainer_is_bit_identical_to_no_callback(sample_data: Path,
                                                                  tmp_path: Path) -> None:
    plain = train(smoke(sample_data, steps=20, probe_every=10), tmp_path / "plain").metrics
    none = train_with_callbacks(smoke(sample_data, steps=20, probe_every=10), tmp_path / "none",
                                callbacks=[KeyControlCallback(KeyControlConfig("none"))]).metrics
    pd.testing.assert_frame_equal(plain[COLS], none[COLS], check_exact=True)
