"""Key control switched on through the config / CLI, not by passing a callback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from qkgeom import QKGeomError, make_config, train
from qkgeom.training import train as train_with_callbacks


@pytest.mark.parametrize("over, words", [
    ({"key_control": {"mode": "squash"}}, "key_control.mode"),
    ({"key_control": {"scope": "model"}}, "key_control.scope"),
    ({"key_control": {"how": "later"}}, "key_control.how"),
    ({"key_control": {"shrink_to": 0.0}}, "key_control.shrink_to"),
    ({"key_control": {"shrink_to": 1.5}}, "key_control.shrink_to"),
    ({"key_control": {"expand_to": 0.5}}, "key_control.expand_to"),
    ({"key_control": "hold"}, "must be a mapping"),
])
def test_bad_control_settings_are_clear_errors(over: dict, words: str) -> None:
    with pytest.raises(QKGeomError, match=words):
        make_config("smoke", over)


def test_shrink_from_the_config_reaches_its_target(sample_data: Path, tmp_path: Path) -> None:
    cfg = make_config("smoke", {"data": str(sample_data), "steps": 30, "probe_every": 10,
                                "key_control": {"mode": "shrink", "shrink_to": 0.5},
                                "threads": 1})
    m = train(cfg, tmp_path / "r").metrics
    pr_k = m[(m["metric"] == "pr_k_weight") & (m["head"] == -1)].pivot_table(
        index="step", columns="layer", values="value")
    assert (pr_k.loc[30] / pr_k.loc[0]).between(0.5 - 1e-3, 0.5 + 1e-3).all()
    assert m["metric"].str.startswith("ctl_").any()


def test_the_bare_trainer_refuses_a_feature_no_callback_serves(sample_data: Path,
                                                               tmp_path: Path) -> None:
    """training.train knows no feature: a config asking for key control needs its callback
    (qkgeom.train builds it); nothing is written before the refusal."""
    cfg = make_config("smoke", {"data": str(sample_data), "key_control": {"mode": "hold"}})
    with pytest.raises(QKGeomError, match="key_control.*qkgeom.train"):
        train_with_callbacks(cfg, tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_cli_key_control_flags(sample_data: Path, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "qkgeom.cli", "train", "--preset", "smoke", "--quiet",
            "--data", str(sample_data), "--steps", "20", "--probe-every", "10"]
    res = subprocess.run([*base, "--out", str(tmp_path / "h"), "--key-control", "hold",
                          "--key-control-scope", "head"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    m = pd.read_parquet(tmp_path / "h" / "metrics.parquet")
    # head scope: one control unit per head of each layer (smoke: 2 layers x 2 heads)
    units = {n.removeprefix("ctl_target_") for n in m["metric"] if n.startswith("ctl_target_")}
    assert units == {"l0h0", "l0h1", "l1h0", "l1h1"}
    bad = subprocess.run([*base, "--out", str(tmp_path / "b"), "--key-control", "squash"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "key_control.mode" in bad.stderr
    assert "Traceback" not in bad.stderr
