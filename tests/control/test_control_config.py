"""Key control switched on through the config / CLI, not by passing a callback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from qkgeom import QKGeomError, make_config, train
from qkgeom.config import KEY_CONTROL_HOWS, KEY_CONTROL_MODES, KEY_CONTROL_SCOPES
from qkgeom.control import HOWS, MODES, SCOPES


def test_config_names_match_the_control_module() -> None:
    assert (KEY_CONTROL_MODES, KEY_CONTROL_SCOPES, KEY_CONTROL_HOWS) == (MODES, SCOPES, HOWS)


@pytest.mark.parametrize("over, words", [
    ({"key_control": "squash"}, "key_control"),
    ({"key_control_scope": "model"}, "key_control_scope"),
    ({"shrink_to": 0.0}, "shrink_to"),
    ({"shrink_to": 1.5}, "shrink_to"),
    ({"expand_to": 0.5}, "expand_to"),
])
def test_bad_control_settings_are_clear_errors(over: dict, words: str) -> None:
    with pytest.raises(QKGeomError, match=words):
        make_config("smoke", over)


def test_shrink_from_the_config_reaches_its_target(sample_data: Path, tmp_path: Path) -> None:
    cfg = make_config("smoke", {"data": str(sample_data), "steps": 30, "probe_every": 10,
                                "key_control": "shrink", "shrink_to": 0.5, "threads": 1})
    m = train(cfg, tmp_path / "r").metrics
    pr_k = m[(m["metric"] == "pr_k_weight") & (m["head"] == -1)].pivot_table(
        index="step", columns="layer", values="value")
    assert (pr_k.loc[30] / pr_k.loc[0]).between(0.5 - 1e-3, 0.5 + 1e-3).all()
    assert m["metric"].str.startswith("ctl_").any()


def test_cli_key_control_flags(sample_data: Path, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "qkgeom.cli", "train", "--preset", "smoke", "--quiet",
            "--data", str(sample_data), "--steps", "20", "--probe-every", "10"]
    res = subprocess.run([*base, "--out", str(tmp_path / "h"), "--key-control", "hold",
                          "--key-control-scope", "head"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    m = pd.read_parquet(tmp_path / "h" / "metrics.parquet")
    assert m["metric"].str.startswith("ctl_").any()
    bad = subprocess.run([*base, "--out", str(tmp_path / "b"), "--key-control", "squash"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "key_control" in bad.stderr and "Traceback" not in bad.stderr
