"""Reports of one run or of a monitored run (issue 24, point 6): fewer than 5 units give a
descriptive report (no verdict column, the reason in one line), rows that need metrics a
run did not record name the setting that records them, the setup and the figure labels
say what the run is (a monitored pretrained model is not a Q/K init), numbers are
printed at a sensible precision, and the times say which clock they read."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pandas as pd
import pytest
import torch

from .conftest import invoke

pytest.importorskip("matplotlib", reason="reports need qkgeom[report]")


def report_via_cli(folder: Path, out: Path) -> types.SimpleNamespace:
    res = invoke("report", str(folder), "--out", str(out), columns=120)
    assert res.exit_code == 0, (res.output, res.exception)
    return types.SimpleNamespace(stdout=res.stdout, md=(out / "report.md").read_text(),
                                 html=(out / "report.html").read_text(), out=out)


@pytest.fixture(scope="module")
def one_run(smoke_run, tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    """``qkgeom report`` of the smoke run: one run, every metric recorded."""
    return report_via_cli(smoke_run.path, tmp_path_factory.mktemp("one-run") / "report")


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    """A BERT masked-LM fine-tuning loop watched by a GeometryMonitor with its default
    metrics (the token-level ones and pr_qk_weight), then ``qkgeom report`` of it."""
    transformers = pytest.importorskip("transformers", reason="an HF model needs qkgeom[hf]")
    from qkgeom.monitor import GeometryMonitor

    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
        max_position_embeddings=64, vocab_size=96))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(5, 96, (4, 16), generator=gen)
    run = tmp_path_factory.mktemp("monitored") / "bert-mlm"
    with GeometryMonitor(model, probe, every=2, out=run, tensorboard=None,
                         wandb=False) as mon:
        mon.start(0)
        for step in range(1, 7):
            ids = torch.randint(5, 96, (4, 16), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(step, loss=loss)
    return report_via_cli(run, run.parent / "report")


def table_header(md: str) -> str:
    return next(line for line in md.splitlines() if line.startswith("| claim / level |"))


def test_a_one_run_report_is_descriptive(one_run) -> None:
    md = one_run.md
    reason = ("Descriptive: 1 run. A verdict needs at least 5 runs (the exact sign-flip p of "
              "1 run is at least 1/2^1 = 0.5, never below 0.05)")
    assert md.count(reason) == 1
    assert "verdict" not in table_header(md)
    claims = md.split("| claim / level |", 1)[1].split("\n\n", 1)[0]
    assert not re.search(r"\*\*(mixed|not supported|supported)\*\*", claims)
    assert md.splitlines()[2] == "## Health"  # one run: its health first, then the claims
    summary = next(line for line in md.splitlines() if line.startswith("> **E1/E2"))
    assert summary.startswith("> **E1/E2: descriptive, 1 run (a verdict needs at least 5): "
                              "42 claim rows, 30 measured")
    assert md.index("## Health") < md.index(summary)
    readings = md.split("## E1.3 read four ways", 1)[1].split("##", 1)[0]
    assert "verdict" not in readings
    # the terminal: word headers, no verdict column, the reason in one line
    out = one_run.stdout
    header = next(line for line in out.splitlines() if "claim" in line and "┃" in line)
    assert "claim_id" not in header and "p_value" not in header and "verdict" not in header
    assert "┃ id " in header and ("p (adjusted)" in header or "p (sign-flip)" in header)
    assert sum(line.startswith("Descriptive: 1 run.") for line in out.splitlines()) == 1
    assert "verdict v-" not in one_run.html  # no coloured verdict cell


def _claims(n: int) -> pd.DataFrame:
    return pd.DataFrame({
        "claim_id": ["E1.1", "E1.2"], "claim": ["PR_Q expands", "PR_K shrinks"],
        "level": ["token"] * 2, "from": ["step 0"] * 2, "unit": ["runs"] * 2, "n": [n, n],
        "k": [n, 0], "measured": [f"{n}/{n} runs", f"0/{n} runs"], "estimate": ["+1", "-1"],
        "p_value": [0.5 ** n, 1.0], "p_adj": [0.5 ** n, 1.0], "p_sign": [0.5 ** n, 1.0], "beside": ["", ""],
        "verdict": ["supported" if n >= 5 else "mixed", "not supported"],
        "reason": ["", ""]})


@pytest.mark.parametrize("n", [1, 4, 5, 18])
def test_verdicts_need_five_units_and_say_so_below(n: int) -> None:
    from qkgeom.analysis.kit import MIN_UNITS, claims_markdown, claims_summary, descriptive_reason

    assert MIN_UNITS == 5  # the fewest units whose sign-flip p can be below 0.05
    md = claims_markdown(_claims(n))
    if n < MIN_UNITS:
        assert descriptive_reason(_claims(n)).startswith(f"Descriptive: {n} run")
        assert "verdict" not in md.splitlines()[0]
        assert claims_summary(_claims(n)).startswith(f"E1: descriptive, {n} run")
    else:
        assert descriptive_reason(_claims(n)) == ""
        assert "verdict" in md.splitlines()[0] and "**supported**" in md
        assert claims_summary(_claims(n)).startswith("E1: 1 of 2 claims supported")


def test_rows_without_recorded_metrics_name_the_setting(monitored) -> None:
    md = monitored.md
    setting = 'GeometryMonitor(..., metrics="all")'
    from qkgeom.analysis.e1.claims import NO_NULL

    # a one-run report lists the rows its run measured; the others keep their reason in
    # claims.csv, and the report says how many and which setting records the rest
    assert not [line for line in md.splitlines() if "0/0 runs" in line]
    claims = pd.read_csv(monitored.out / "claims.csv", keep_default_na=False)
    rows = claims[(claims["level"] == "weight") & (claims["n"] == 0)]
    unrecorded = rows[~rows["reason"].str.contains(NO_NULL, regex=False)]  # E2: no pair
    assert len(unrecorded), "weight-level rows measure nothing without pr_q_weight"
    for reason in unrecorded["reason"]:
        assert "not recorded: " in reason and setting in reason, reason
    assert "claim rows measure nothing on this run" in md
    assert "**Not recorded here**:" in md and f"`{setting}` records every metric" in md
    line = [x for x in monitored.stdout.splitlines() if "measured nothing" in x]
    assert len(line) == 1 and setting in line[0] and "pr_q_weight" in line[0], line


def test_a_monitored_model_is_labelled_as_what_it_is(monitored) -> None:
    setup = monitored.md.split("## Setup", 1)[1].split("## Excluded", 1)[0]
    assert "**Monitored model**: BertForMaskedLM, depth 2" in setup
    assert "Q/K inits" not in setup and "normal" not in setup
    assert "probes of 16 tokens" in setup  # the probe's length, not a context
    figures = sorted(monitored.out.glob("*.svg"))
    assert figures
    for svg in figures:
        text = svg.read_text(encoding="utf-8")
        assert "BertForMaskedLM" in text and "normal" not in text, svg.name


def test_numbers_print_at_a_sensible_precision() -> None:
    from qkgeom.analysis.kit import signed

    assert signed(9.25e-18) == "0.000" and signed(-3e-7) == "0.000"
    assert signed(0.0) == "0.000"
    assert signed(0.004) == "+0.004" and signed(-1.234567) == "-1.235"
    assert signed(float("nan")) == "n/a"


def test_times_say_which_clock_they_read(one_run) -> None:
    setup = one_run.md.split("## Setup", 1)[1].split("## Excluded", 1)[0]
    assert "Wall time" not in setup
    assert "**Training time** (training steps only" in setup
    # (the span includes any pause between attempts: the suite resumes this run later)
    assert re.search(r"\*\*Wall-clock time\*\*: [\d.]+ (s|min|h) from the first run's start "
                     r"to the last run's end", setup), setup
