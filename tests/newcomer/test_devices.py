"""``device: auto`` (CUDA, then MPS, then CPU) is the default everywhere; what a run
resolved to is recorded; auto changes no config hash and no metric on a CPU; a run that
would take hours on a CPU says so once, before it starts."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pandas as pd
import pytest
import torch

from qkgeom.config import TrainConfig, detect_device, make_config
from qkgeom.training import resolve_device


def test_auto_is_the_default_and_resolves() -> None:
    assert TrainConfig().device == "auto" and make_config("paper").device == "auto"
    assert resolve_device("auto") == torch.device(detect_device())
    expected = "cuda" if torch.cuda.is_available() else detect_device()
    assert detect_device() == expected
    # the paper preset is bf16 where it is meant to run (a GPU), fp32 on a CPU
    paper = make_config("paper")
    assert paper.effective_precision == ("bf16" if expected == "cuda" else "fp32")


def test_auto_hashes_as_the_device_it_resolves_to() -> None:
    cfg = make_config("smoke")
    here = dataclasses.replace(cfg, device=detect_device())
    assert cfg.config_hash() == here.config_hash()  # old runs (device cpu) resume on a CPU
    assert dataclasses.replace(cfg, device="cpu").config_hash() == \
        dataclasses.replace(cfg, device="cpu", precision="fp32").config_hash()


def test_the_run_records_what_it_ran_on(smoke_run) -> None:
    record = json.loads((smoke_run.path / "config.json").read_text())
    execution = record["execution"]
    assert execution["device_requested"] == "auto" and execution["precision_requested"] == "auto"
    assert execution["device"] == str(resolve_device("auto"))
    assert record["config"]["device"] == execution["device"]
    assert record["config"]["precision"] == execution["precision"] == \
        ("bf16" if execution["device"].startswith("cuda") else "fp32")
    assert execution["hardware"]


@pytest.mark.skipif(detect_device() != "cpu", reason="auto is the CPU only on a CPU machine")
def test_auto_and_cpu_give_the_same_metrics(sample_data, tmp_path) -> None:
    from qkgeom import train

    over = {"data": str(sample_data), "steps": 4, "probe_every": 2, "eval_every": 2,
            "checkpoint_every": 2, "warmup_steps": 1}
    a = train(make_config("smoke", over), tmp_path / "auto")
    b = train(make_config("smoke", {**over, "device": "cpu"}), tmp_path / "cpu")
    pd.testing.assert_frame_equal(a.metrics.drop(columns="run_id"),
                                  b.metrics.drop(columns="run_id"), check_exact=True)


def test_a_long_run_on_a_cpu_warns_once_with_an_estimate() -> None:
    from qkgeom.training.resources import cpu_seconds, warn_if_long_on_cpu

    paper = make_config("paper")
    with pytest.warns(UserWarning, match=r"this run will take at least \d+(\.\d)? days on this "
                                         r"CPU \(20,000 steps × 64 × 256 tokens\)"):
        seconds = warn_if_long_on_cpu(paper, torch.device("cpu"))
    assert seconds == cpu_seconds(paper) > 86_400
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_long_on_cpu(make_config("small"), torch.device("cpu"))  # minutes: no warning
        warn_if_long_on_cpu(paper, torch.device("meta"))  # an accelerator: no warning


def test_a_paper_sweep_on_a_cpu_warns_with_its_total(monkeypatch) -> None:
    from qkgeom.cli import sweeps
    from qkgeom.experiments import experiment

    configs = [r.config for r in experiment("e1").grid("paper", "data/wt103").expand()]
    monkeypatch.setattr("qkgeom.config.detect_device", lambda: "cpu")
    with pytest.warns(UserWarning, match="the 36 runs of this sweep to train will take at "
                                         "least"):
        sweeps.warn_long_sweep(configs, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sweeps.warn_long_sweep(configs, "cuda")


def test_a_sweep_warns_only_about_the_runs_it_still_has_to_train(tmp_path) -> None:
    from qkgeom.cli.sweeps import unfinished
    from qkgeom.experiments import experiment
    from qkgeom.io import write_json
    from qkgeom.runs.sweep import run_dir

    runs = experiment("e1").grid("paper", "data/wt103").expand()
    for r in runs[:30]:
        write_json(run_dir(tmp_path, r.run_id) / "status.json", {"state": "done", "step": 1})
    write_json(run_dir(tmp_path, runs[30].run_id) / "status.json",
               {"state": "running", "step": 1})
    assert [r.run_id for r in unfinished(tmp_path, runs)] == [r.run_id for r in runs[30:]]


def test_the_python_api_analyses_on_auto_by_default(smoke_run, tmp_path) -> None:
    """``analyze_checkpoints`` and ``reproduce_e4`` default to ``auto`` as the CLI does (a
    GPU user of the API gets the GPU; ``auto`` was an unknown torch device here before)."""
    import inspect

    from qkgeom import analyze_checkpoints
    from qkgeom.experiments import reproduce_e4

    assert inspect.signature(analyze_checkpoints).parameters["device"].default == "auto"
    out = analyze_checkpoints([str(smoke_run.path)], tmp_path / "an")
    metrics = pd.read_parquet(out / "metrics.parquet")
    pr_k = metrics[metrics["metric"] == "pr_k_token"]
    assert pr_k["checkpoint"].nunique() >= 2 and pr_k["value"].notna().all()
    assert inspect.signature(reproduce_e4).parameters["device"].default is None  # -> auto
