"""E4 end to end (what ``qkgeom reproduce e4`` runs), smoke size: a run per seed trained with
the log checkpoint schedule, each run's checkpoints analysed as a family in token blocks,
the report over seeds; rerunning finishes only what is missing. And a local family given
as ``model``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from hf_models import save_family

from qkgeom.errors import QKGeomError
from qkgeom.experiments import E4_PRESETS, experiment, reproduce_e4
from qkgeom.io import read_json
from qkgeom.runs import list_checkpoints
from qkgeom.training.checkpoint import checkpoint_steps


def test_the_demo_preset_is_the_documented_one() -> None:
    cfg = experiment("e4").grid("demo").expand()[0].config
    m = cfg.model
    assert (m.n_layer, m.n_embd, m.n_head, m.block_size, m.qk_init) == (4, 128, 4, 64, "normal")
    assert (cfg.batch_size, cfg.seed, cfg.steps, cfg.keep_checkpoints) == (32, 0, 1024, 0)
    steps = checkpoint_steps(cfg.steps, cfg.checkpoint_every, cfg.checkpoint_schedule)
    assert steps[:8] == [0, 1, 2, 4, 8, 16, 32, 64] and steps[-1] == 1024
    assert len(steps) == 23 >= 12
    demo = E4_PRESETS["demo"]
    assert (demo.tokens, demo.blocks, demo.text) == (32768, 8, "sample")
    assert demo.seeds == (0, 1, 2, 3, 4) and cfg.warmup_steps == 100  # 15 checkpoints after
    assert [s.config.seed for s in experiment("e4").grid("demo").expand()] == [0, 1, 2, 3, 4]
    with pytest.raises(QKGeomError, match="--model"):
        experiment("e4").grid("paper")
    with pytest.raises(QKGeomError, match="unknown E4 preset"):
        experiment("e4").grid("huge")


def _trained(out: Path) -> dict[str, int]:
    return {f"{run.name}/{p.name}": p.stat().st_mtime_ns
            for run in sorted((out / "train" / "runs").iterdir())
            for _, p in list_checkpoints(run)}


@pytest.fixture(scope="module")
def smoke_e4(sample_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """``reproduce_e4("smoke")`` interrupted after 3 analysed checkpoints, then run again
    to the end: (its folder, the checkpoints analysed in each call, the trained checkpoints'
    mtimes after the first call, after the second)."""
    out = tmp_path_factory.mktemp("e4") / "e4"
    import qkgeom.checkpoints.analyze as analyze_mod

    original, seen = analyze_mod.analyze_model, []

    def interrupted(model, tok, texts, **kw):  # stop the first attempt after 3 checkpoints
        seen.append(kw["checkpoint"])
        if len(seen) == 4:
            raise KeyboardInterrupt
        return original(model, tok, texts, **kw)

    patch = pytest.MonkeyPatch()
    patch.setattr(analyze_mod, "analyze_model", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            reproduce_e4("smoke", out, data=str(sample_data), progress=False)
        trained = _trained(out)
        folder = reproduce_e4("smoke", out, data=str(sample_data), progress=False)
    finally:
        patch.undo()
    return folder, seen, trained, _trained(out)


@pytest.mark.slow
def test_smoke_e4_trains_analyses_reports_and_resumes(smoke_e4) -> None:
    folder, seen, trained, again = smoke_e4
    want = [0, 1, 2, 4, 8, 16, 32, 40]
    for seed in (0, 1):  # both seeds trained in the first call
        assert sorted(int(name.split("/")[1][5:13]) for name in trained
                      if name.startswith(f"seed={seed}/")) == want
    assert again == trained  # kept: the second call trained nothing
    assert len(seen) == 4 + 5 + 8  # the 3 cached checkpoints were not analysed again
    assert (folder / "e4.json").is_file() and (folder / "report" / "report.md").is_file()
    text = (folder / "report" / "report.md").read_text()
    assert "Unit: the seed" in text and "With 2 seeds no claim can be supported" in text
    for seed in (0, 1):
        an = folder / "analysis" / f"seed-{seed}"
        assert (an / "report" / "report.md").is_file()
        m = pd.read_parquet(an / "metrics.parquet")
        assert sorted(m["step"].unique()) == want
        assert set(m["block"]) == {-1, *range(8)}
        ck = pd.read_parquet(an / "checkpoints.parquet")
        assert (ck["tokens"] == 2048).all() and (ck["seq_len"] == 32).all()  # the context
        assert {"contrast_token_heads", "logit_std"} <= set(m["metric"])
        assert read_json(an / "analysis.json")["warmup_steps"] == 5  # the run's warm-up
    trends = pd.read_csv(folder / "report" / "trends.csv")
    assert set(trends["unit"]) == {"seed-0", "seed-1"}
    assert (trends["n"] == 4).all() and (trends["n_warmup"] == 4).all()  # 8, 16, 32, 40


@pytest.mark.slow
def test_a_local_family_as_model(tmp_path: Path) -> None:
    save_family(tmp_path / "fam", "gpt_neox", [0, 4, 16, 64])
    folder = reproduce_e4("smoke", tmp_path / "e4", model=str(tmp_path / "fam"),
                          revisions=["step0", "step4", "step16", "step64"], tokens=1024,
                          progress=False)
    assert not (tmp_path / "e4" / "train").exists()
    assert folder == tmp_path / "e4" / "analysis"
    assert read_json(folder / "analysis.json")["warmup_steps"] is None  # not recorded
    m = pd.read_parquet(folder / "metrics.parquet")
    assert sorted(m["step"].unique()) == [0, 4, 16, 64] and set(m["block"]) == {-1, *range(8)}
    assert "pr_q_token_post" in set(m["metric"])  # rotary: pre-rotary PRs, post beside
    assert (folder / "report" / "report.md").is_file()
    with pytest.raises(QKGeomError, match="--model"):
        reproduce_e4("smoke", tmp_path / "x", revisions=["step0"])
    with pytest.raises(QKGeomError, match="training run"):
        reproduce_e4("smoke", tmp_path / "x", model=str(tmp_path / "fam"), data="d")


@pytest.mark.slow
def test_reproduce_e4_through_the_cli(smoke_e4, sample_data: Path) -> None:
    """The CLI on the finished smoke E4 (the API test above trained and analysed it from
    scratch; a folder records where it is, so it is taken up in place): it trains and
    analyses nothing again, writes the report over seeds and prints the claims."""
    import subprocess
    import sys

    out = smoke_e4[0]
    trained = _trained(out)
    cached = {p.name: p.stat().st_mtime_ns
              for p in (out / "analysis" / "seed-0" / "checkpoints").iterdir()}
    (out / "report" / "report.md").unlink()
    res = subprocess.run([sys.executable, "-m", "qkgeom.cli", "reproduce", "e4", "--preset",
                          "smoke", "--data", str(sample_data), "--out", str(out), "--quiet"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "seed-0: layer 0" in res.stdout and "E4.1" in res.stdout
    assert (out / "report" / "report.md").is_file()
    assert _trained(out) == trained
    assert {p.name: p.stat().st_mtime_ns
            for p in (out / "analysis" / "seed-0" / "checkpoints").iterdir()} == cached
    bad = subprocess.run([sys.executable, "-m", "qkgeom.cli", "reproduce", "e1", "--model",
                          "x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "are for e4" in bad.stderr and "Traceback" not in bad.stderr
