"""Hugging Face ``transformers.Trainer`` with ``mon.hf_callback()``: a tiny GPT-2 trained
for a few steps on the embedded Wikipedia text, offline, with and without the monitor."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from qkgeom.io import read_json
from qkgeom.monitor import GeometryMonitor

from .conftest import tiny_gpt2

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS = 5


class Windows(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def fit(tmp, vocab: int, windows: torch.Tensor, monitor: dict | None):
    model = tiny_gpt2(vocab)
    args = transformers.TrainingArguments(
        output_dir=str(tmp / "hf"), max_steps=STEPS, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=["tensorboard"],
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    mon = GeometryMonitor(model, **monitor) if monitor is not None else None
    callbacks = [mon.hf_callback()] if mon is not None else []
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Windows(windows),
                                   callbacks=callbacks)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, losses, mon


@pytest.mark.slow
def test_hf_trainer_callback(tmp_path, corpus, probe_tokens, train_windows) -> None:
    vocab = corpus.vocab.vocab_size
    m0, losses0, _ = fit(tmp_path / "plain", vocab, train_windows, None)
    out = tmp_path / "mon" / "run"
    m1, losses1, mon = fit(tmp_path / "mon", vocab, train_windows,
                           {"probe": probe_tokens, "every": 2, "out": out})
    assert len(losses0) == STEPS and losses0 == losses1
    for (name, p0), p1 in zip(m0.named_parameters(), m1.parameters(), strict=True):
        assert torch.equal(p0, p1), name
    assert [p.step for p in mon.probes] == [0, 2, 4, 5]  # train begin, cadence, train end
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert sorted(metrics["step"].unique()) == [0, 2, 4, 5]
    assert read_json(out / "status.json")["state"] == "done"
    assert pd.read_parquet(out / "train_log.parquet")["loss"].tolist() == pytest.approx(losses1)
    # report_to tensorboard: the monitor writes into the Trainer's own run (its writer),
    # so the geometry and the Trainer's train/loss are one TensorBoard run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = [p for p in (tmp_path / "mon" / "hf" / "runs").iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    acc = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert "train/loss" in scalars and "attention/entropy/layer0" in scalars
    assert [e.step for e in acc.Scalars("pr/k_token/layer1")] == [0, 2, 4, 5]
    assert "key_spectrum/sv_weight/layer1" in acc.Tags()["histograms"]
