"""One measurement path: the trainer's probes, the monitor, ``measure`` and ``qkgeom analyze``
of a run folder give the same numbers for the same model and tokens."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from qkgeom import GeometryMonitor, make_config, measure, train
from qkgeom.checkpoints import analyze_checkpoints
from qkgeom.data import load_prepared, probe_set
from qkgeom.training.checkpoint import load_model

KEYS = ["layer", "head", "metric"]


def _at(frame: pd.DataFrame, step: int | None = None, delta: bool = False) -> pd.DataFrame:
    """Rows at ``step``; logit_delta (a change since the previous probe) only with ``delta``."""
    if step is not None:
        frame = frame[frame["step"] == step]
    frame = frame[(frame["metric"] == "logit_delta") == delta]
    return frame[[*KEYS, "value"]].sort_values(KEYS).reset_index(drop=True)


@pytest.mark.slow
def test_trainer_monitor_measure_and_analyze_agree(sample_data: Path, tmp_path: Path) -> None:
    cfg = make_config("smoke", {"data": str(sample_data), "steps": 20, "probe_every": 10,
                                "checkpoint_every": 10, "threads": 1})
    run = tmp_path / "run"
    trained = train(cfg, run).metrics
    model, step = load_model(run)
    assert step == 20
    ids = probe_set(load_prepared(sample_data).val, cfg.probe_sequences, cfg.model.block_size)
    want = _at(trained, 20)
    assert len(want) > 0 and set(want["metric"]) >= {"pr_q_token", "attn_entropy", "pr_qk_weight"}

    direct = _at(measure(model, ids, batch_size=cfg.probe_batch).frame)
    pd.testing.assert_frame_equal(direct, want, check_exact=True)
    # the change since the previous probe: the trainer's = measuring step 20 after step 10
    before = measure(load_model(run, 10)[0], ids, batch_size=cfg.probe_batch)
    after = measure(model, ids, batch_size=cfg.probe_batch, previous=before)
    assert len(_at(trained, 20, delta=True)) == (cfg.model.n_head + 1) * cfg.model.n_layer
    pd.testing.assert_frame_equal(_at(after.frame, delta=True), _at(trained, 20, delta=True),
                                  check_exact=True)

    mon = GeometryMonitor(model, ids, every=1, metrics="all", batch_size=cfg.probe_batch,
                          tensorboard=None, wandb=False, alerts=())
    pd.testing.assert_frame_equal(_at(mon.probe(20).frame), want, check_exact=True)

    folder = analyze_checkpoints([str(run)], tmp_path / "ckpt")
    analysed = pd.read_parquet(folder / "metrics.parquet")
    assert sorted(analysed["step"].unique()) == [10, 20]
    pd.testing.assert_frame_equal(_at(analysed, 20), want, check_exact=True)
    pd.testing.assert_frame_equal(_at(analysed, 10), _at(trained, 10), check_exact=True)
