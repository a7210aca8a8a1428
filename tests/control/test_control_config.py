"""Key control switched on through the config / CLI, not by passing a callback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from qkgeom import QKGeomError, make_config, train
from qkgeom.config import KeyControlConfig
from qkgeom.launch import callbacks_for
from qkgeom.training import train as train_with_callbacks


@pytest.mark.parametrize("over, words", [
    ({"key_control": {"mode": "squash"}}, "key_control.mode"),
    ({"key_control": {"scope": "model"}}, "key_control.scope"),
    ({"key_control": {"how": "later"}}, "key_control.how"),
    ({"key_control": {"scale": "norm"}}, "key_control.scale"),
    ({"key_control": {"mode": "shrink", "dose": 1.5}}, "dose must be in (0, 1] for shrink"),
    ({"key_control": {"mode": "shrink", "dose": -0.5}}, "dose must be > 0"),
    ({"key_control": {"mode": "expand", "dose": 0.5}}, "dose must be >= 1 for expand"),
    ({"key_control": {"mode": "sham", "dose": 0.5}}, "dose is fixed at 1 for sham"),
    ({"key_control": {"mode": "hold", "dose": 0.5}}, "dose is not used by hold"),
    ({"key_control": {"mode": "hold", "scale": "frobenius", "reference": "seed=0,arm=none"}},
     "hold with the frobenius rule reads nothing from it"),
    ({"key_control": {"mode": "none", "reference": "x"}}, "none with the data rule reads nothing"),
    ({"key_control": {"mode": "hold", "level": "heads"}}, "unknown key_control.level 'heads'"),
    ({"key_control": {"mode": "shrink", "ramp_steps": -2}}, "ramp_steps"),
    ({"key_control": {"record": "yes"}}, "key_control.record"),
    ({"key_control": {"shrink_to": 0.5}},
     "unknown config key 'key_control.shrink_to'; did you mean 'key_control.dose'?"),
    ({"shrink_to": 0.5}, "unknown config key 'shrink_to'; did you mean 'key_control.dose'?"),
    ({"key_control": "hold"}, "must be a mapping"),
])
def test_bad_control_settings_are_clear_errors(over: dict, words: str) -> None:
    with pytest.raises(QKGeomError, match=re.escape(words)) as info:
        make_config("smoke", over)
    assert "\n" not in str(info.value)


def test_dose_defaults_per_mode_and_an_explicit_default_is_the_same_run() -> None:
    doses = {m: make_config("smoke", {"key_control": {"mode": m}}).key_control.dose
             for m in KeyControlConfig.MODES}
    assert doses == {"none": None, "hold": None, "shrink": 0.5, "sham": 1.0, "expand": 2.0}
    implicit = make_config("smoke", {"key_control": {"mode": "shrink"}})
    explicit = make_config("smoke", {"key_control": {"mode": "shrink", "dose": 0.5}})
    assert implicit.config_hash() == explicit.config_hash()
    assert make_config("smoke", {"key_control": {"mode": "sham", "dose": 1}}).key_control.dose == 1


def test_record_alone_is_a_feature_the_callback_serves(tmp_path: Path) -> None:
    cfg = make_config("smoke", {"key_control": {"record": True}})
    assert cfg.active_features() == ["key_control"]
    assert make_config("smoke").active_features() == []
    (cb,) = callbacks_for(cfg, tmp_path / "run")
    assert cb.feature == "key_control"
    with pytest.raises(QKGeomError, match="run folder"):
        callbacks_for(cfg)  # where would key_pr.parquet go?


def test_shrink_from_the_config_reaches_its_target(sample_data: Path, tmp_path: Path) -> None:
    cfg = make_config("smoke", {"data": str(sample_data), "steps": 30, "probe_every": 10,
                                "key_control": {"mode": "shrink", "dose": 0.5,
                                                "level": "weight"},
                                "threads": 1})
    m = train(cfg, tmp_path / "r").metrics
    pr_k = m[(m["metric"] == "pr_k_weight") & (m["head"] == -1)].pivot_table(
        index="step", columns="layer", values="value")
    ctl = m[m["metric"].str.startswith("ctl_")].pivot_table(index="step", columns="metric",
                                                              values="value")
    for layer in (0, 1):  # no reference: the cap is 0.5 x PR0 after the ramp (warm-up, 5)
        assert ctl.loc[30, f"ctl_sched_l{layer}"] == pytest.approx(0.5 * pr_k.loc[0, layer])
        assert pr_k.loc[30, layer] <= 0.5 * pr_k.loc[0, layer] * (1 + 1e-3)  # at or below
        assert pr_k.loc[30, layer] == pytest.approx(ctl.loc[30, f"ctl_target_l{layer}"],
                                                    rel=1e-3)


def test_the_bare_trainer_refuses_a_feature_no_callback_serves(sample_data: Path,
                                                               tmp_path: Path) -> None:
    """training.train knows no feature: a config asking for key control needs its callback
    (qkgeom.train builds it); nothing is written before the refusal."""
    cfg = make_config("smoke", {"data": str(sample_data), "key_control": {"mode": "hold"}})
    with pytest.raises(QKGeomError, match="key_control.*qkgeom.train"):
        train_with_callbacks(cfg, tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_cli_key_control_flags(sample_data: Path, tmp_path: Path) -> None:
    """``--key-control hold --key-control-scope head --key-control-level weight``: one
    control unit per head, each head's weight PR_K held at its own step-0 value at every
    probe."""
    base = [sys.executable, "-m", "qkgeom.cli", "train", "--preset", "smoke", "--quiet",
            "--data", str(sample_data), "--steps", "10", "--probe-every", "5"]
    res = subprocess.run([*base, "--out", str(tmp_path / "h"), "--key-control", "hold",
                          "--key-control-scope", "head", "--key-control-level", "weight"],
                         capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    m = pd.read_parquet(tmp_path / "h" / "metrics.parquet")
    # head scope: one control unit per head of each layer (smoke: 2 layers x 2 heads)
    units = {n.removeprefix("ctl_target_") for n in m["metric"] if n.startswith("ctl_target_")}
    assert units == {"l0h0", "l0h1", "l1h0", "l1h1"}
    target = m[m["metric"].str.startswith("ctl_target_")].pivot_table(
        index="step", columns="metric", values="value")
    probed = m[(m["metric"] == "pr_k_weight") & (m["head"] >= 0)].pivot_table(
        index="step", columns=["layer", "head"], values="value")
    assert list(target.index) == [0, 5, 10]
    for layer in (0, 1):
        for head in (0, 1):
            held = target[f"ctl_target_l{layer}h{head}"]
            assert (held == held.loc[0]).all()  # hold: the head's PR0 throughout
            assert held.loc[0] == pytest.approx(probed.loc[0, (layer, head)], rel=1e-6)
            assert ((probed[(layer, head)] - held).abs() / held).max() < 1e-3
    # the whole layer is not a unit here: its PR_K is free to move
    layer_pr = m[(m["metric"] == "pr_k_weight") & (m["head"] == -1)].pivot_table(
        index="step", columns="layer", values="value")
    assert (layer_pr.loc[10] != layer_pr.loc[0]).all()
    bad = subprocess.run([*base, "--out", str(tmp_path / "b"), "--key-control", "squash"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "key_control.mode" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_old_run_folders_are_refused_in_one_line(sample_data: Path, tmp_path: Path) -> None:
    """A format-2 record (key control before doses: ``shrink_to``) is not migrated: reading
    or resuming it is one line saying what to do, and nothing is written."""
    import json

    from qkgeom.runs import load_config

    cfg = make_config("smoke", {"data": str(sample_data), "steps": 4, "probe_every": 2,
                                "checkpoint_every": 2, "warmup_steps": 1, "threads": 1})
    train(cfg, tmp_path / "r")
    path = tmp_path / "r" / "config.json"
    record = json.loads(path.read_text())
    record["config"]["key_control"] = {"mode": "shrink", "scope": "layer", "how": "post_step",
                                       "shrink_to": 0.5, "expand_to": 2.0}
    path.write_text(json.dumps({**record, "format_version": 2}))
    files = {p: p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file()}
    for call in (lambda: load_config(tmp_path / "r"),
                 lambda: train(cfg, tmp_path / "r", resume=True)):
        with pytest.raises(QKGeomError, match=r"older qkgeom \(run folder format 2\).*"
                                              "train it again") as info:
            call()
        assert "\n" not in str(info.value)
    assert {p: p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file()} == files
