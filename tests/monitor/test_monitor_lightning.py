"""Lightning with ``mon.lightning_callback()``: a real ``LightningModule`` around a tiny
GPT-2; the monitor finds the trainer's ``TensorBoardLogger`` and writes into its events."""

from __future__ import annotations

import pytest
import torch

from qkgeom.monitor import GeometryMonitor

from .conftest import tiny_gpt2

pl = pytest.importorskip("lightning.pytorch")

STEPS = 4


class LitLM(pl.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(tmp, vocab: int, windows: torch.Tensor, monitor: dict | None):
    from lightning.pytorch.loggers import TensorBoardLogger

    model = tiny_gpt2(vocab)
    mon = GeometryMonitor(model, **monitor) if monitor is not None else None
    logger = TensorBoardLogger(str(tmp), name="lit")
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=logger,
                         callbacks=[mon.lightning_callback()] if mon else [],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1)
    loader = torch.utils.data.DataLoader(windows, batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    pl.seed_everything(0, verbose=False)
    trainer.fit(LitLM(model), loader)
    return model, mon, logger


@pytest.mark.slow
def test_lightning_callback(tmp_path, corpus, probe_tokens, train_windows) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    vocab = corpus.vocab.vocab_size
    m0, _, _ = fit(tmp_path / "plain", vocab, train_windows, None)
    m1, mon, logger = fit(tmp_path / "mon", vocab, train_windows,
                          {"probe": probe_tokens, "every": 2, "out": tmp_path / "run"})
    for (name, p0), p1 in zip(m0.named_parameters(), m1.parameters(), strict=True):
        assert torch.equal(p0, p1), name
    assert [p.step for p in mon.probes] == [0, 2, 4]
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    # one section per metric family, in the Lightning logger's own run
    assert "pr/k_token/layer1" in acc.Tags()["scalars"]
    assert "key_spectrum/eig_token/layer0" in acc.Tags()["histograms"]
    assert (tmp_path / "run" / "train_log.parquet").exists()  # losses from training_step
