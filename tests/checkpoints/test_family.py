"""A family of saved tiny checkpoints: steps, duplicates, cache and resume, the report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hf_models import ARCHS, TEXT, build, save_family, transformers, write_trainer_state

from qkgeom.analysis.e4.report import load_analysis, write_e4_report
from qkgeom.checkpoints.analyze import analyze_model
from qkgeom.checkpoints.family import analyze_checkpoints
from qkgeom.checkpoints.resolve import resolve_checkpoints
from qkgeom.errors import QKGeomError
from qkgeom.geometry import METRIC_NAMES, POST_ROTARY_METRICS


def weight_pr(w) -> float:
    """Participation ratio of the squared singular values of a weight, by hand."""
    import torch

    lam = torch.linalg.svdvals(w.detach().double()) ** 2
    return float(lam.sum() ** 2 / (lam ** 2).sum())


def text_file(tmp_path: Path) -> str:
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_family_is_analysed_per_checkpoint(arch: str, tmp_path: Path) -> None:
    folders = save_family(tmp_path / "ckpts", arch, [0, 10, 100, 1000])
    out = analyze_checkpoints([str(f) for f in reversed(folders)], tmp_path / "an",
                              text=text_file(tmp_path), max_tokens=300, seq_len=40, blocks=1)
    m = pd.read_parquet(out / "metrics.parquet")
    assert list(m.columns) == ["run_id", "checkpoint", "step", "layer", "head", "metric",
                               "value", "block", "duplicate_of", "in_trends"]
    assert sorted(m["step"].unique()) == [0, 10, 100, 1000]  # parsed from the names
    rotary = arch in ("gpt_neox", "llama")  # pre-rotary token PRs, post-rotary ones beside
    # each checkpoint is measured on its own (in any order, on any worker): no logit_delta
    assert set(m["metric"]) == {n for n in METRIC_NAMES if n != "logit_delta"
                                and (rotary or n not in POST_ROTARY_METRICS)}
    assert m["value"].notna().all() and (m["block"] == -1).all()
    assert set(m["head"]) == {-1, 0, 1, 2, 3}  # query heads (4) under GQA too
    # each checkpoint's rows are its own weights' (seed = step): the layer PRs by hand
    from qkgeom.arch import adapter_for

    layer = m[m["head"] == -1].set_index(["step", "layer", "metric"])["value"]
    for step in (0, 1000):
        for site in adapter_for(build(arch, seed=step)).sites:
            for which in ("q", "k"):
                want = weight_pr(site.weight(which))
                got = layer[(step, site.layer, f"pr_{which}_weight")]
                assert got == pytest.approx(want, rel=1e-6), (step, site.layer, which)
    ck = pd.read_parquet(out / "checkpoints.parquet")
    assert ck["tokens"].tolist() == [300] * 4 and ck["duplicate_of"].isna().all()
    assert ck["qk_hash"].nunique() == 4
    assert sorted(p.name for p in out.iterdir()) == [
        "analysis.json", "checkpoints", "checkpoints.parquet", "metrics.parquet"]
    trends = load_analysis(out)["trends"]  # statistics are the report's, not the folder's
    assert set(trends["layer"]) == {0, 1} and (trends["n"] == 4).all()
    meta = json.loads((out / "analysis.json").read_text())
    assert meta["state"] == "done"


@pytest.mark.slow
def test_duplicate_revisions_are_flagged_and_left_out(tmp_path: Path) -> None:
    # step1 serves step0's weights (Pythia's fault); step20 serves the final step's
    folders = save_family(tmp_path / "c", "gpt2", [0, 1, 10, 20, 30],
                          duplicate={1: 0, 20: 30})
    out = analyze_checkpoints([str(f) for f in folders], tmp_path / "an",
                              text=text_file(tmp_path), max_tokens=120, seq_len=40, blocks=1)
    ck = pd.read_parquet(out / "checkpoints.parquet").set_index("checkpoint")
    assert ck.loc["step0", "duplicate_of"] == "step1"  # the later name is kept
    assert ck.loc["step20", "duplicate_of"] == "step30"
    assert ck["in_trends"].tolist() == [False, True, True, False, True]
    assert (load_analysis(out)["trends"]["n"] == 3).all()
    md = write_e4_report(out).read_text()
    assert "`step0` = `step1`" in md and "left out of every trend statistic" in md
    assert md.index("## Claims") < md.index("## Setup")
    for png in ("contrast_steps.png", "prefix_trend.png", "qk_entropy_heads.png"):
        assert (out / "report" / png).stat().st_size > 1000
    kept = analyze_checkpoints([str(f) for f in folders], tmp_path / "kept", keep_duplicates=True,
                               text=text_file(tmp_path), max_tokens=120, seq_len=40, blocks=1)
    assert (load_analysis(kept)["trends"]["n"] == 5).all()


def test_an_interrupted_analysis_resumes_from_its_cache(tmp_path: Path, monkeypatch) -> None:
    folders = save_family(tmp_path / "c", "llama", [0, 5, 50])
    args = ([str(f) for f in folders], tmp_path / "an")
    kw = {"text": text_file(tmp_path), "max_tokens": 100, "seq_len": 25, "blocks": 2}
    import qkgeom.checkpoints.analyze as analyze_mod

    calls: list[str] = []
    original = analyze_mod.analyze_model

    def flaky(model, tok, texts, **k):
        calls.append(k["checkpoint"])
        if k["checkpoint"] == "step50" and len(calls) == 3:
            raise KeyboardInterrupt
        return original(model, tok, texts, **k)

    monkeypatch.setattr(analyze_mod, "analyze_model", flaky)
    with pytest.raises(KeyboardInterrupt):
        analyze_checkpoints(*args, **kw)
    assert sorted(p.name for p in (tmp_path / "an" / "checkpoints").glob("*.json")) == \
        ["step0.json", "step5.json"]
    first = pd.read_parquet(tmp_path / "an" / "checkpoints" / "step0.parquet")
    analyze_checkpoints(*args, **kw)
    assert calls == ["step0", "step5", "step50", "step50"]  # only the missing one again
    m = pd.read_parquet(tmp_path / "an" / "metrics.parquet")
    pd.testing.assert_frame_equal(
        m[m["checkpoint"] == "step0"][first.columns].reset_index(drop=True), first)
    with pytest.raises(QKGeomError, match="other settings"):
        analyze_checkpoints(*args, **{**kw, "max_tokens": 99})


def test_steps_from_trainer_state_or_list_order(tmp_path: Path) -> None:
    a, b = save_family(tmp_path / "x", "bert", [3, 4])
    a2, b2 = a.rename(tmp_path / "late"), b.rename(tmp_path / "early")
    write_trainer_state(a2, 900)
    write_trainer_state(b2, 100)
    specs = resolve_checkpoints([str(a2), str(b2)])
    assert [(s.name, s.step, s.step_source) for s in specs] == \
        [("early", 100, "trainer_state"), ("late", 900, "trainer_state")]
    (b2 / "trainer_state.json").unlink()
    specs = resolve_checkpoints([str(a2), str(b2)])
    assert [(s.name, s.step, s.step_source) for s in specs] == [("late", 0, "order"),
                                                               ("early", 1, "order")]
    hub = resolve_checkpoints(["EleutherAI/pythia-160m"], ["step1000", "step0", "step512"])
    assert [(s.revision, s.step) for s in hub] == [("step0", 0), ("step512", 512),
                                                   ("step1000", 1000)]
    save_family(tmp_path / "y", "bert", [40, 3])
    folder = resolve_checkpoints([str(tmp_path / "y")])  # a folder of checkpoint folders
    assert [(s.name, s.step) for s in folder] == [("step3", 3), ("step40", 40)]


def test_token_blocks_are_the_same_at_every_checkpoint_and_each_equals_its_tokens_alone(
        tmp_path: Path) -> None:
    """blocks=4 over 10 windows of 20 tokens: blocks of 3, 2, 3, 2 windows; block −1 is the
    unblocked analysis; block k equals analysing block k's own tokens. (A batch never
    straddles two blocks; one window per batch keeps the batches of all three analyses
    alike, so the float32 sums agree bit for bit.)"""
    folders = save_family(tmp_path / "c", "llama", [0, 7])
    kw = {"text": text_file(tmp_path), "max_tokens": 200, "seq_len": 20, "batch_size": 1}
    out = analyze_checkpoints([str(f) for f in folders], tmp_path / "an", blocks=4, **kw)
    m = pd.read_parquet(out / "metrics.parquet")
    ck = pd.read_parquet(out / "checkpoints.parquet")
    assert ck["blocks"].tolist() == [4, 4]
    for name in ("step0", "step7"):
        assert sorted(m[m["checkpoint"] == name]["block"].unique()) == [-1, 0, 1, 2, 3]
    plain = analyze_checkpoints([str(f) for f in folders], tmp_path / "plain", blocks=1, **kw)
    p = pd.read_parquet(plain / "metrics.parquet")
    cols = ["checkpoint", "layer", "head", "metric", "value"]
    pd.testing.assert_frame_equal(m[m["block"] == -1][cols].reset_index(drop=True), p[cols],
                                  check_exact=True)
    model = build("llama", seed=7)  # step7's weights, and the tokenizer saved beside them
    tokenizer = transformers.AutoTokenizer.from_pretrained(folders[1])
    one = m[m["checkpoint"] == "step7"]
    start = 0
    for block, windows in enumerate([3, 2, 3, 2]):
        alone = analyze_model(model, tokenizer, TEXT[start * 20:(start + windows) * 20],
                              max_tokens=windows * 20, seq_len=20, batch_size=1)
        start += windows
        got = one[one["block"] == block][["layer", "head", "metric", "value"]]
        np.testing.assert_array_equal(got["value"].to_numpy(), alone["value"].to_numpy())
        assert got["metric"].tolist() == alone["metric"].tolist()
    assert {"pr_q_token_post", "contrast_token_post"} <= set(one["metric"])  # rotary: both sites
