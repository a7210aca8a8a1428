"""Plain training loop: bit-identical training, and every output read back by its reader
(TensorBoard's event reader, a real W&B run in offline mode read back from its own log file,
``qkgeom show``/``watch``/``report``)."""

from __future__ import annotations

import json
import shutil
import struct
import types
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from qkgeom.io import read_json
from qkgeom.monitor import GeometryMonitor

from .conftest import tiny_gpt2

STEPS, EVERY = 6, 2
_WANDB_HEADER, _WANDB_BLOCK = 7, 32768  # ":W&B" + 0xBEE1 + version; log blocks of 32 KiB


def wandb_records(path: Path):
    """The protobuf records of a W&B run log (``run-<id>.wandb``, W&B's LevelDB-style log:
    a 7-byte header, then 32 KiB blocks of chunks ``crc u32, length u16, type u8, data``;
    type 1 = a whole record, 2/3/4 = its first/middle/last piece)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, pieces = _WANDB_HEADER, b""
    while pos + 7 <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if left < 7:  # the block's zero-padded tail
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def train(vocab: int, windows: torch.Tensor, monitor_kw: dict | None) -> tuple:
    """A few AdamW steps of a tiny GPT-2 with dropout; returns (model, losses, monitor)."""
    model = tiny_gpt2(vocab)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    mon = GeometryMonitor(model, **monitor_kw) if monitor_kw is not None else None
    if mon is not None:
        mon.start(0, total_steps=STEPS)
    losses = []
    for step in range(STEPS):
        x = windows[torch.randint(0, len(windows), (4,), generator=gen)]  # (4, T)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if mon is not None:
            mon.step(step + 1, loss=loss)
    if mon is not None:
        mon.close()
    return model, losses, mon


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, probe_tokens, train_windows):
    """The same training without and with a monitor; the monitored one inside a real W&B
    run in offline mode (nothing leaves the machine), which the monitor finds by itself."""
    wandb = pytest.importorskip("wandb")
    tmp = tmp_path_factory.mktemp("plain")
    patch = pytest.MonkeyPatch()
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        patch.setenv(var, str(tmp / "wandb-home"))
    patch.setenv("WANDB_MODE", "offline")
    patch.setenv("WANDB_SILENT", "true")
    (tmp / "wandb-home").mkdir()
    try:
        plain = train(corpus.vocab.vocab_size, train_windows, None)
        kw = dict(probe=probe_tokens, every=EVERY, metrics="all", out=tmp / "sweep/runs/mon-a",
                  tensorboard=tmp / "tb")
        run = wandb.init(project="qkgeom-tests", dir=str(tmp / "wandb-home"))
        try:
            monitored = train(corpus.vocab.vocab_size, train_windows, kw)
        finally:
            run.finish()
    finally:
        patch.undo()
    (log,) = (tmp / "wandb-home").rglob("offline-run-*/run-*.wandb")
    return types.SimpleNamespace(tmp=tmp, plain=plain, monitored=monitored, wandb_log=log)


def test_monitored_training_is_bit_identical(runs) -> None:
    (m0, losses0, _), (m1, losses1, mon) = runs.plain, runs.monitored
    assert losses0 == losses1
    for (name, p0), p1 in zip(m0.named_parameters(), m1.parameters(), strict=True):
        assert torch.equal(p0, p1), name
    assert m1.training and all(m.training for m in m1.modules())
    assert [p.step for p in mon.probes] == [0, 2, 4, 6]


def test_run_folder_follows_spec7(runs) -> None:
    run = runs.tmp / "sweep/runs/mon-a"
    metrics = pd.read_parquet(run / "metrics.parquet")
    assert list(metrics.columns) == ["run_id", "step", "layer", "head", "metric", "value"]
    assert sorted(metrics["step"].unique()) == [0, 2, 4, 6]
    assert set(metrics["run_id"]) == {"mon-a"}
    # 2 layers × ((2 heads + layer) × 19 metrics + 3 layer-only ones) per probe (no rotary:
    # no _post metrics), + logit_delta from the second probe on
    assert metrics.groupby("step").size().tolist() == [120] + [120 + 2 * 3] * 3
    for name in ("logit_max", "sink_mass", "q_norm_max", "k_norm_max", "logit_bound"):
        rows = metrics[(metrics["metric"] == name) & (metrics["step"] == STEPS)]
        assert sorted(rows["head"]) == [-1, -1, 0, 0, 1, 1], name  # heads and layer rows
    low = metrics[metrics["metric"] == "entropy_min"]
    assert len(low) == 2 * 4 and set(low["head"]) == {-1}  # layer rows only
    status = read_json(run / "status.json")
    assert status["state"] == "done" and status["step"] == STEPS == status["steps"]
    cfg = read_json(run / "config.json")
    assert cfg["config"]["model"]["n_layer"] == 2 and cfg["config"]["steps"] == STEPS
    assert cfg["model"]["arch"] == "gpt2" and cfg["source"] == "qkgeom.monitor"
    log = pd.read_parquet(run / "train_log.parquet")
    assert log["step"].tolist() == list(range(1, STEPS + 1))
    assert log["loss"].tolist() == pytest.approx(runs.monitored[1])


def test_tensorboard_event_files_read_back(runs) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs.tmp / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scalars, hists = acc.Tags()["scalars"], acc.Tags()["histograms"]
    # one section per metric family: pr/, contrast/, attention/, key_spectrum/
    assert {"pr/k_token/layer0", "attention/entropy/layer1", "contrast/token/layer0",
            "attention/logit_std/layer1", "attention/entropy_min/layer0"} <= set(scalars)
    # the per-head metrics: one tag per head and one per layer
    for name in ("logit_max", "sink_mass", "q_norm_max", "k_norm_max", "logit_bound"):
        assert {f"attention/{name}/layer{layer}{head}" for layer in (0, 1)
                for head in ("", "/head0", "/head1")} <= set(scalars), name
    assert not any("/head" in t for t in scalars if "logit_std" in t or "pr/" in t)
    assert not any(t.startswith("qkgeom/") for t in scalars)
    assert {"key_spectrum/sv_weight/layer0", "key_spectrum/eig_token/layer1"} <= set(hists)
    mon = runs.monitored[2]
    for name, metric, layer, head in (("pr/k_token/layer1", "pr_k_token", 1, -1),
                                      ("attention/logit_max/layer0/head1", "logit_max", 0, 1),
                                      ("attention/sink_mass/layer1/head0", "sink_mass", 1, 0)):
        events = acc.Scalars(name)
        want = mon.history.query(f"metric == '{metric}' and layer == {layer} and head == {head}")
        assert [e.step for e in events] == want["step"].tolist()
        assert [e.value for e in events] == pytest.approx(want["value"].tolist(), rel=1e-6)
    hist = acc.Histograms("key_spectrum/sv_weight/layer0")[-1].histogram_value
    assert hist.num == 32  # one singular value per key dimension (d_k = 32)


def test_wandb_gets_scalars_and_histograms_on_its_own_step_axis(runs) -> None:
    history, metrics = [], []
    for record in wandb_records(runs.wandb_log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "metric":
            metrics.append((record.metric.name or record.metric.glob_name,
                            record.metric.step_metric))
    assert [h["qkgeom/step"] for h in history] == [0, 2, 4, 6]
    mon = runs.monitored[2]
    assert history[-1]["pr/q_token/layer0"] == pytest.approx(
        mon.last.layer_values("pr_q_token")[0], rel=1e-6)
    first = mon.probes[0]
    assert history[0]["pr/k_token/layer1"] == pytest.approx(
        first.layer_values("pr_k_token")[1], rel=1e-6)
    last = mon.last.frame.set_index(["layer", "head", "metric"])["value"]
    for key, row in (("attention/logit_max/layer1/head0", (1, 0, "logit_max")),
                     ("attention/logit_bound/layer0/head1", (0, 1, "logit_bound")),
                     ("attention/k_norm_max/layer0", (0, -1, "k_norm_max")),
                     ("attention/entropy_min/layer1", (1, -1, "entropy_min"))):
        assert history[-1][key] == pytest.approx(last[row], rel=1e-6), key
    hist = history[0]
    assert hist["key_spectrum/sv_weight/layer1/_type"] == "histogram"
    assert sum(hist["key_spectrum/sv_weight/layer1/values"]) == 32  # one singular value per d_k
    assert {("pr/*", "qkgeom/step"), ("attention/*", "qkgeom/step")} <= set(metrics)


def test_qkgeom_show_and_watch_read_the_run(runs) -> None:
    from qkgeom.cli import app

    run = runs.tmp / "sweep/runs/mon-a"
    cli = CliRunner()
    shown = cli.invoke(app, ["show", str(run)])
    assert shown.exit_code == 0, shown.output
    # the table's title wraps where the folder's path is long
    assert "per-layer Q/K geometry at step 6" in " ".join(shown.output.split())
    watched = cli.invoke(app, ["watch", "--once", str(run)])
    assert watched.exit_code == 0, watched.output
    assert "probe at step 6" in watched.output and "done" in watched.output


@pytest.mark.slow
def test_qkgeom_report_reads_a_folder_of_monitored_runs(runs) -> None:
    from qkgeom.cli import app

    run = runs.tmp / "sweep/runs/mon-a"
    cli = CliRunner()
    second = runs.tmp / "sweep/runs/mon-b"  # a second run in the folder (another run_id)
    shutil.copytree(run, second)
    m = pd.read_parquet(second / "metrics.parquet").assign(run_id="mon-b")
    m.to_parquet(second / "metrics.parquet")
    cfg = read_json(second / "config.json")
    cfg.update(run_id="mon-b")
    cfg["config"]["seed"] = 1
    (second / "config.json").write_text(__import__("json").dumps(cfg))
    reported = cli.invoke(app, ["report", str(runs.tmp / "sweep")])
    assert reported.exit_code == 0, reported.output
    report = (runs.tmp / "sweep/report/report.md").read_text()
    assert "E1.2" in report and "left out" not in reported.output


def test_resume_and_clobber(runs, probe_tokens) -> None:
    from qkgeom.errors import QKGeomError

    model = tiny_gpt2(50)
    with pytest.raises(QKGeomError, match="already holds a run"):
        GeometryMonitor(model, probe_tokens % 50, out=runs.tmp / "sweep/runs/mon-a")
    Path(runs.tmp / "x").mkdir()
    mon = GeometryMonitor(model, probe_tokens % 50, out=runs.tmp / "x", every=1,
                          tensorboard=None, wandb=False)
    mon.start(0)
    mon.close()
    mon = GeometryMonitor(model, probe_tokens % 50, out=runs.tmp / "x", every=1, resume=True)
    mon.start(1)
    mon.close()
    assert sorted(pd.read_parquet(runs.tmp / "x/metrics.parquet")["step"].unique()) == [0, 1]
