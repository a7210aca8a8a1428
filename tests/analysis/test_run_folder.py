"""``qkgeom report RUN_DIR`` on one run folder: trained by ``qkgeom train``, or written by a
:class:`~qkgeom.monitor.GeometryMonitor` around a plain training loop (which may record only
some metrics, and whose config.json may hold no training config). What cannot be computed
is skipped with a note, never a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from qkgeom.analysis import claims_table, write_report

KINDS = ("pr", "contrast", "qk_entropy", "heads")
#: Drawn once per report from the token-level statistics (protocol 2).
PROTOCOL2_FIGURES = {"per_layer", "reference_sensitivity"}
ALL_FIGURES = {f"{kind}_{level}" for kind in KINDS for level in ("weight", "token")} \
    | PROTOCOL2_FIGURES
# What the monitor records by default (DEFAULT_METRICS) lets these figures be drawn:
MONITOR_FIGURES = {"pr_token", "contrast_token", "qk_entropy_weight", "heads_weight"} \
    | PROTOCOL2_FIGURES
#: The claims table's rows of the run-level value: 6 claims × 2 levels × 2 origins, E2.3
#: once per level, E2.1 and E2.2 also without the cross-run null.
CLAIM_ROWS = 30
VOCAB, T, STEPS = 40, 16, 6


def _claim_rows(md: Path) -> list[str]:
    """The rows of the claims table under its claim groups (one per level and origin)."""
    return [line for line in md.read_text(encoding="utf-8").splitlines()
            if line.startswith(("| weight |", "| token |"))]


def _shows_measured_rows(md: Path) -> None:
    """A one-run report lists the claim rows its run measured (each of its 1 run), and
    says how many of the :data:`CLAIM_ROWS` measure nothing (their reasons: claims.csv)."""
    rows = _claim_rows(md)
    assert rows and all("/1 runs" in row for row in rows), rows
    if len(rows) < CLAIM_ROWS:
        assert (f"{CLAIM_ROWS - len(rows)} of {CLAIM_ROWS} claim rows measure nothing on "
                "this run") in md.read_text(encoding="utf-8")


def _pngs(md: Path) -> set[str]:
    return {p.stem for p in md.parent.glob("*.png")}


@pytest.fixture(scope="module")
def trained(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qkgeom.cli import app

    out = tmp_path_factory.mktemp("trained") / "smoke-run"
    res = CliRunner().invoke(app, ["train", "--preset", "smoke", "--data", str(sample_data),
                                   "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    return out


def _monitored(out: Path, metrics: object = None) -> Path:
    """A tiny qkgeom GPT trained for a few steps by a plain loop under a GeometryMonitor."""
    from qkgeom import GPT, GPTConfig
    from qkgeom.monitor import GeometryMonitor

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=T, vocab_size=VOCAB))
    probe = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw = {} if metrics is None else {"metrics": metrics, "alerts": ()}
    mon = GeometryMonitor(model, probe, every=2, out=out, tensorboard=None, wandb=False, **kw)
    mon.start(0, total_steps=STEPS)
    gen = torch.Generator().manual_seed(2)
    for step in range(STEPS):
        x = torch.randint(0, VOCAB, (4, T), generator=gen)
        logits = model(x)
        logits = logits[0] if isinstance(logits, tuple) else logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step(step + 1, loss=loss)
    mon.close()
    return out


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _monitored(tmp_path_factory.mktemp("monitored") / "mon")


def test_report_of_a_trained_run_folder(trained: Path) -> None:
    from qkgeom.cli import app

    res = CliRunner().invoke(app, ["report", str(trained)])
    assert res.exit_code == 0, res.output
    md = trained / "report" / "report.md"
    text = md.read_text(encoding="utf-8")
    assert text.startswith("# qkgeom report: smoke-run")
    _shows_measured_rows(md)
    assert f"- **Run folder**: `smoke-run` ({trained}); analysed." in text
    assert "Not recorded here" not in text and "Skipped" not in text
    assert _pngs(md) == ALL_FIGURES
    claims = pd.read_csv(md.parent / "claims.csv")
    assert set(claims.loc[claims["claim_id"].str.startswith("E1"), "n"]) == {1}  # one run
    e1 = claims[claims["claim_id"].str.startswith("E1") & claims["layer"].isna()]
    assert e1["beside"].str.contains(r"layer trajectories \d/2").all()  # its 2 layers
    per_layer = claims[claims["layer"].notna()]
    # one trajectory each (none for E2.1/E2.2: one run has no cross-run null)
    assert per_layer["beside"].str.contains(r"layer trajectories \d/[01]").all()
    assert (md.parent / "report.html").stat().st_size > 0


def test_report_of_a_monitored_run_folder_with_some_metrics(monitored: Path) -> None:
    record = json.loads((monitored / "config.json").read_text())
    assert record["source"] == "qkgeom.monitor"
    recorded = set(pd.read_parquet(monitored / "metrics.parquet")["metric"])
    # the monitor's default metrics, and those its default alert rules read
    assert recorded == {"pr_q_token", "pr_k_token", "contrast_token", "pr_qk_weight",
                        "attn_entropy", "entropy_min", "sink_mass", "logit_max", "q_norm_max",
                        "k_norm_max", "logit_bound", "attn_entropy_norm", "attn_max"}
    md = write_report(monitored)
    text = md.read_text(encoding="utf-8")
    _shows_measured_rows(md)
    assert ("**Not recorded here**: `pr_q_weight`, `pr_k_weight`, `contrast_weight`, "
            "`pr_qk_token`.") in text
    assert "**Monitored** (1 run(s)" in text and "6 steps" in text
    assert _pngs(md) == MONITOR_FIGURES
    skipped = text.split("Skipped (their metrics are not recorded here): ", 1)[1]
    assert "(a) PR_Q and PR_K — weight level (no `pr_q_weight`, `pr_k_weight`)" in skipped
    assert "(d) Heads: interaction PR vs attention entropy — token level" in skipped
    table = claims_table(monitored)
    layer_mean = table[table["layer"].isna()]
    claims = layer_mean[~layer_mean["statistic"].isin(["rho_k_qk", "rho_qk_entropy"])] \
        .set_index(["claim_id", "level", "origin"])
    assert claims.loc[("E1.1", "token", "step0"), "n"] == 1  # one run
    assert "/2" in claims.loc[("E1.1", "token", "step0"), "beside"]  # its 2 layers
    assert claims.loc[("E1.1", "weight", "step0"), "verdict"] == "not evaluated"
    # pr_qk_weight with entropy: the within-run ρ of its one run; the cross-run null has
    # no other run to pair with, and says so
    within = layer_mean[layer_mean["statistic"] == "rho_qk_entropy"].set_index(
        ["level", "origin"])
    assert within.loc[("weight", "step0"), "n"] == 1
    assert claims.loc[("E2.2", "weight", "step0"), "n"] == 0
    assert claims.loc[("E2.2", "weight", "step0"), "reason"].startswith("no other run")


def test_monitored_run_whose_config_holds_no_training_config(monitored: Path,
                                                             tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "bare"
    shutil.copytree(monitored, run, ignore=shutil.ignore_patterns("report"))
    record = json.loads((run / "config.json").read_text())
    record["config"] = {}
    record.pop("config_hash", None)
    (run / "config.json").write_text(json.dumps(record))
    md = write_report(run)
    text = md.read_text(encoding="utf-8")
    _shows_measured_rows(md)
    setup = text.split("## Setup", 1)[1].split("## Excluded", 1)[0]
    assert "**Monitored model**: GPT, depth 2" in setup  # from the monitor's model facts
    assert "Q/K inits" not in setup  # the monitor did not build the model
    assert "n/a steps" in setup and "**Training**" not in setup
    assert _pngs(md) == MONITOR_FIGURES
    tables_only = write_report(run, tmp_path / "tables", figures=False)
    assert "No figures: not drawn (`figures=False`)." in tables_only.read_text(encoding="utf-8")
    assert not _pngs(tables_only)


def test_monitored_run_with_a_single_metric(tmp_path: Path) -> None:
    run = _monitored(tmp_path / "one", metrics=["pr_q_token"])
    assert set(pd.read_parquet(run / "metrics.parquet")["metric"]) == {"pr_q_token"}
    md = write_report(run)
    text = md.read_text(encoding="utf-8")
    _shows_measured_rows(md)
    claims = pd.read_csv(md.parent / "claims.csv")
    evaluated = claims.loc[claims["verdict"] != "not evaluated", "claim_id"]
    assert set(evaluated) == {"E1.1"}  # ΔPR_Q at the token level is all it can measure
    # E1.1 per layer and against the reference: all it can draw
    assert _pngs(md) == PROTOCOL2_FIGURES and "Skipped" in text
