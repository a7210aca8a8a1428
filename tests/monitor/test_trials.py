"""Trials (qkgeom.monitor.trials): HF GPT-2 and Llama trained in a plain loop under the
monitor, at the smoke size, on the embedded Wikipedia sample (nothing downloaded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("transformers")

from qkgeom.monitor import trials  # noqa: E402
from qkgeom.runs import read_alerts, read_log, read_metrics, read_record, read_status  # noqa: E402

SMOKE = trials.PRESETS["smoke"]


@pytest.fixture(scope="module")
def grid(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The smoke grid (GPT-2 and Llama, lr 1e-2, seed 0), trained once in this process."""
    out = tmp_path_factory.mktemp("trials") / "grid"
    lines: list[str] = []
    trials.run_grid(SMOKE, out, workers=1, data_dir=sample_data, echo=lines.append)
    return out, lines


def _layer(run: Path, metric: str) -> pd.DataFrame:
    m = read_metrics(run)
    return m[(m["metric"] == metric) & (m["head"] == -1) & (m["layer"] >= 0)]


@pytest.mark.parametrize("family", trials.FAMILIES)
def test_a_smoke_trial_trains_and_records_a_monitor_run(grid, family: str) -> None:
    out, lines = grid
    run = out / "runs" / f"{family}-lr0.01-s0"
    assert read_status(run)["state"] == "done"
    assert read_status(run)["step"] == SMOKE.settings.steps
    log = read_log(run)
    val = log.dropna(subset=["val_loss"]).set_index("step")["val_loss"]
    # val loss at step 0, every eval_every steps and at the end; training loss every step
    assert list(val.index) == list(range(0, SMOKE.settings.steps + 1, SMOKE.settings.eval_every))
    assert val.iloc[-1] < val.iloc[0] - 1.0  # it learns (≈ 6.3 -> 3.2 nats per character)
    assert log["loss"].notna().sum() == SMOKE.settings.steps
    assert np.isnan(log.set_index("step").loc[0, "loss"])
    ent = _layer(run, "attn_entropy")
    assert sorted(ent["step"].unique()) == list(range(0, SMOKE.settings.steps + 1, 5))
    record = read_record(run)
    assert record["trial"]["family"] == family and record["trial"]["lr"] == 0.01
    assert (record["trial"]["seed"], record["trial"]["steps"], record["trial"]["warmup_steps"]) \
        == (0, SMOKE.settings.steps, SMOKE.settings.warmup_steps)
    assert record["hf_config"]["model_type"] == family
    assert record["config"]["lr"] == 0.01 and record["config"]["warmup_steps"] == 3
    assert any(line.split()[1] == run.name and " done " in line for line in lines)


def test_collation_and_show_read_the_grid(grid, capsys: pytest.CaptureFixture[str]) -> None:
    from cli_helpers import in_process

    from qkgeom.analysis.collate import collate

    out, _ = grid
    listed = json.loads((out / "trials.json").read_text())
    assert listed["grid"]["preset"] == "smoke"
    assert [r["run_id"] for r in listed["runs"]] == ["gpt2-lr0.01-s0", "llama-lr0.01-s0"]
    c = collate(out)
    runs = c.runs.set_index("run_id")
    assert set(runs.index) == {r["run_id"] for r in listed["runs"]}
    assert (runs["excluded"] == "").all()
    for _, r in runs.iterrows():
        trial = read_record(r["dir"])["trial"]
        assert (r["lr"], r["seed"], r["steps"], r["warmup_steps"]) == (
            trial["lr"], trial["seed"], trial["steps"], trial["warmup_steps"])
        last_val = read_log(r["dir"])["val_loss"].dropna().iloc[-1]
        assert r["final_val_loss"] == pytest.approx(last_val)
    assert runs.loc["llama-lr0.01-s0", "qk_init"] == "LlamaForCausalLM"
    assert set(c.metrics["run_id"]) == set(runs.index)
    code, text, err = in_process(["show", str(out / "runs" / "llama-lr0.01-s0")], capsys)
    assert code == 0 and "step 30" in text and "entropy" in text, err


@pytest.fixture(scope="module")
def llama_again(sample_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """The grid's Llama run trained again into another folder, its trained model kept."""
    from qkgeom.data import load_prepared

    out = tmp_path_factory.mktemp("again") / "llama"
    model = trials.build_model("llama", SMOKE.settings,
                               load_prepared(sample_data).vocab.vocab_size, 0)
    summary = trials.train_trial(trials.Trial("llama", 0.01, 0), SMOKE.settings, out,
                                 data_dir=sample_data, model=model)
    assert summary["state"] == "done"
    return out, model


def test_llama_metrics_pair_query_heads_with_their_key_head(llama_again,
                                                            sample_data: Path) -> None:
    """Grouped-query attention (4 query heads, 2 key heads): the per-head PR_K rows repeat
    their key head's value, and each query head's attention entropy at the last probe
    equals the one computed here from the trained model's own attention weights (eager)
    on the probe set (the heads differ by up to 0.5 nats there)."""
    from qkgeom.data import load_prepared, probe_set

    run, model = llama_again
    s = SMOKE.settings
    assert read_record(run)["model"]["n_kv_head"] == 2
    m = read_metrics(run)
    pr_k = m[(m["metric"] == "pr_k_token") & (m["step"] == s.steps) & (m["head"] >= 0)]
    for layer, rows in pr_k.groupby("layer"):
        v = rows.set_index("head")["value"]
        assert v[0] == v[1] and v[2] == v[3] and v[0] != v[2], (layer, v)
    model.eval().set_attn_implementation("eager")
    ids = probe_set(load_prepared(sample_data).val, s.probe_sequences, s.block_size)
    with torch.no_grad():
        att = model(input_ids=ids, output_attentions=True).attentions  # (B, H, T, T) each
    ent = m[(m["metric"] == "attn_entropy") & (m["step"] == s.steps) & (m["head"] >= 0)]
    for layer, p in enumerate(att):
        p = p.double()
        h = -(p * torch.log(p.clamp_min(1e-300))).sum(-1).mean((0, 2))  # (H,)
        got = ent[ent["layer"] == layer].set_index("head")["value"].sort_index()
        np.testing.assert_allclose(got.to_numpy(), h.numpy(), rtol=1e-4)


def test_same_seed_same_metrics(grid, llama_again) -> None:
    out, _ = grid
    again, _ = llama_again
    first = out / "runs" / "llama-lr0.01-s0"
    cols = ["step", "layer", "head", "metric", "value"]
    pd.testing.assert_frame_equal(read_metrics(again)[cols], read_metrics(first)[cols])
    pd.testing.assert_frame_equal(read_log(again), read_log(first))


def test_a_high_learning_rate_is_recorded_as_collapsed_or_diverged(
        sample_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from qkgeom.analysis.stability.outcomes import COLLAPSE_NATS

    monkeypatch.setattr(trials, "PRESETS", {"smoke": SMOKE})
    monkeypatch.setattr("qkgeom.data.ensure_sample_data", lambda *a, **k: sample_data)
    code = trials.main(["--preset", "smoke", "--out", str(tmp_path / "g"), "--workers", "1",
                        "--families", "gpt2", "--lrs", "3", "30"])
    text, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    collapsed = tmp_path / "g" / "runs" / "gpt2-lr3-s0"
    assert read_status(collapsed)["state"] == "done"
    last = _layer(collapsed, "attn_entropy")
    assert last[last["step"] == 30]["value"].min() < COLLAPSE_NATS
    from qkgeom.alerts import DEFAULT_RULES

    assert {a["rule"] for a in read_alerts(collapsed)} & {r.name for r in DEFAULT_RULES}
    diverged = tmp_path / "g" / "runs" / "gpt2-lr30-s0"
    status = read_status(diverged)
    assert status["state"] == "diverged" and "non-finite" in status["message"]
    bad = status["diverged_step"]
    assert isinstance(bad, int) and 0 < bad <= 30 and status["step"] == bad - 1
    assert read_metrics(diverged)["step"].max() <= bad  # probes up to the divergence
    assert "gpt2-lr30-s0" in text and "diverged" in text


def test_rerunning_skips_finished_runs_and_restarts_an_interrupted_one(
        grid, sample_data: Path, tmp_path: Path) -> None:
    out, _ = grid
    copy = tmp_path / "grid"
    shutil.copytree(out, copy)
    gpt2, llama = copy / "runs" / "gpt2-lr0.01-s0", copy / "runs" / "llama-lr0.01-s0"
    status = json.loads((llama / "status.json").read_text())
    (llama / "status.json").write_text(json.dumps({**status, "state": "interrupted",
                                                   "step": 12}))
    (llama / "metrics.parquet").unlink()  # what a killed run may lack
    kept = (gpt2 / "status.json").stat().st_mtime_ns
    lines: list[str] = []
    trials.run_grid(SMOKE, copy, workers=1, data_dir=sample_data, echo=lines.append)
    assert [line.split()[1:3] for line in lines] == [["gpt2-lr0.01-s0", "skipped"],
                                                    ["llama-lr0.01-s0", "done"]]
    assert (gpt2 / "status.json").stat().st_mtime_ns == kept
    assert read_status(llama)["state"] == "done"
    pd.testing.assert_frame_equal(read_metrics(llama).drop(columns="run_id"),
                                  read_metrics(out / "runs" / llama.name).drop(columns="run_id"))
    lines.clear()
    trials.run_grid(SMOKE, copy, workers=1, data_dir=sample_data, echo=lines.append)
    assert all(line.split()[2] == "skipped" for line in lines) and len(lines) == 2


def test_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    for argv in (["--preset", "huge", "--out", str(tmp_path / "a")],
                 ["--preset", "smoke", "--out", str(afile)],
                 ["--preset", "smoke", "--out", str(tmp_path / "b"), "--families", "bert"],
                 ["--preset", "smoke", "--out", str(tmp_path / "c"), "--lrs", "0"],
                 ["--preset", "smoke", "--out", str(tmp_path / "d"), "--workers", "0"],
                 ["--preset", "smoke", "--workers", "two"]):
        try:
            code = trials.main(argv)
        except SystemExit as exc:  # argparse's own refusals (a flag's type)
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("qkgeom: error: ") and err.count("\n") == 1, argv
    assert not (tmp_path / "a").exists() and afile.read_text() == "x"


def test_a_grid_of_other_settings_is_refused(grid, tmp_path: Path, sample_data: Path) -> None:
    import dataclasses

    from qkgeom.errors import QKGeomError

    out, _ = grid
    copy = tmp_path / "grid"
    shutil.copytree(out, copy)
    other = dataclasses.replace(SMOKE, settings=dataclasses.replace(SMOKE.settings, steps=31))
    with pytest.raises(QKGeomError, match="other settings"):
        trials.run_grid(other, copy, workers=1, data_dir=sample_data, echo=lambda _: None)


@pytest.mark.slow
def test_two_worker_processes_give_the_in_process_results(grid, sample_data: Path,
                                                          tmp_path: Path) -> None:
    out, _ = grid
    lines: list[str] = []
    trials.run_grid(SMOKE, tmp_path / "g", workers=2, data_dir=sample_data, echo=lines.append)
    assert len(lines) == 2
    for rid in ("gpt2-lr0.01-s0", "llama-lr0.01-s0"):
        pd.testing.assert_frame_equal(read_metrics(tmp_path / "g" / "runs" / rid),
                                      read_metrics(out / "runs" / rid))


def test_the_monitor_records_settings_sections_val_loss_and_a_divergence(
        corpus, probe_tokens, tmp_path: Path) -> None:
    """What the trials need of GeometryMonitor: ``config=`` over its inferred TrainConfig,
    ``record=`` sections, ``val_loss`` rows, extra status keys; refusals in one line."""
    from qkgeom.errors import QKGeomError
    from qkgeom.monitor import GeometryMonitor

    from .conftest import tiny_gpt2

    model = tiny_gpt2(corpus.vocab.vocab_size)
    with pytest.raises(QKGeomError, match="unknown config key 'learning_rte'"):
        GeometryMonitor(model, probe_tokens, config={"learning_rte": 1e-3})
    with pytest.raises(QKGeomError, match="may not set 'model'"):
        GeometryMonitor(model, probe_tokens, record={"model": {}})
    with pytest.raises(QKGeomError, match="JSON values"):
        GeometryMonitor(model, probe_tokens, record={"trial": {"lr": float("nan")}})
    mon = GeometryMonitor(model, probe_tokens, every=2, out=tmp_path / "m", total_steps=4,
                          config={"lr": 0.5, "seed": 7, "warmup_steps": 1},
                          record={"trial": {"family": "gpt2"}}, alerts=())
    mon.start(0)
    mon.log_loss(0, None, 0.0, val_loss=5.0)
    mon.step(1, loss=torch.tensor(4.0), lr=0.5)
    mon.step(2, loss=3.0, lr=0.25, val_loss=3.5)
    mon.close("diverged", 2, diverged_step=3, message="non-finite loss (nan) at step 3")
    record = read_record(tmp_path / "m")
    assert record["trial"] == {"family": "gpt2"}
    assert (record["config"]["lr"], record["config"]["seed"], record["config"]["steps"],
            record["config"]["warmup_steps"]) == (0.5, 7, 4, 1)
    log = read_log(tmp_path / "m").set_index("step")
    assert log["val_loss"].tolist()[0] == 5.0 and np.isnan(log.loc[0, "loss"])
    assert np.isnan(log.loc[1, "val_loss"]) and log.loc[1, "loss"] == 4.0
    assert (log.loc[2, "loss"], log.loc[2, "val_loss"], log.loc[2, "lr"]) == (3.0, 3.5, 0.25)
    status = read_status(tmp_path / "m")
    assert (status["state"], status["step"], status["diverged_step"]) == ("diverged", 2, 3)
    assert sorted(read_metrics(tmp_path / "m")["step"].unique()) == [0, 2]
