"""The project's own runs: an analysis of the run's text reproduces the trainer's probes,
and an exported run is a GPT2LMHeadModel with identical logits."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from qkgeom import make_config, train
from qkgeom.checkpoints import analyze_model, export_run
from qkgeom.checkpoints.resolve import load_run_model
from qkgeom.data import load_prepared
from qkgeom.errors import QKGeomError

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # trains a smoke run (and prepares the sample once)


@pytest.fixture(scope="module")
def run(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = make_config("smoke", {"data": str(sample_data), "steps": 20, "probe_every": 10,
                                "checkpoint_every": 10, "keep_checkpoints": 5})
    return train(cfg, tmp_path_factory.mktemp("own") / "run").out_dir


def test_token_prs_equal_the_trainers_probes(run: Path, sample_data: Path) -> None:
    cfg = make_config("smoke", {})
    n_seq, T = cfg.probe_sequences, cfg.model.block_size
    val_text = load_prepared(sample_data).vocab.decode(load_prepared(sample_data).val[: n_seq * T])
    probes = pd.read_parquet(run / "metrics.parquet")
    for step in (10, 20):
        model, vocab, _ = load_run_model(run, step)
        # the val split is where the trainer's probe set comes from (its first n_seq × T)
        got = analyze_model(model, vocab, val_text, max_tokens=n_seq * T, seq_len=T,
                            precision="float64")
        # a checkpoint measured alone has no previous probe: no logit_delta
        want = probes[(probes["step"] == step) & (probes["metric"] != "logit_delta")]
        merged = got.merge(want, on=["layer", "head", "metric"], suffixes=("", "_trainer"))
        assert len(merged) == len(want) > 0
        for metric in ("pr_q_token", "pr_k_token", "contrast_token", "pr_qk_token",
                       "attn_entropy", "pr_q_weight", "pr_qk_weight"):
            sel = merged[merged["metric"] == metric]
            assert sel["value"].to_numpy() == pytest.approx(sel["value_trainer"].to_numpy(),
                                                            rel=1e-9, abs=1e-12), metric


def test_run_folder_checkpoints_are_a_family(run: Path, tmp_path: Path) -> None:
    from qkgeom.checkpoints.family import analyze_checkpoints

    (tmp_path / "t.txt").write_text("a short text for the character model.\n" * 20)
    out = analyze_checkpoints([str(run)], tmp_path / "an", text=str(tmp_path / "t.txt"),
                              max_tokens=200, blocks=1)
    ck = pd.read_parquet(out / "checkpoints.parquet")
    assert ck["step"].tolist() == [10, 20] and (ck["step_source"] == "run").all()
    assert (ck["arch"] == "qkgeom").all()


def test_export_gives_identical_logits_and_char_tokens(run: Path, tmp_path: Path) -> None:
    out = export_run(run, tmp_path / "hf", step=20)
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model, vocab, _ = load_run_model(run, 20)
    text = "Anthropology is the study of humans\n and their ☃ societies."
    ids = vocab.encode(text).astype("int64")
    assert tok(text, add_special_tokens=False)["input_ids"] == ids.tolist()
    x = torch.from_numpy(ids[: model.config.block_size])[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(QKGeomError, match="not empty"):
        export_run(run, out)
    with pytest.raises(QKGeomError, match="no checkpoint at step 7"):
        export_run(run, tmp_path / "other", step=7)
