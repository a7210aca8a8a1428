"""A run tells its own story first (issue 37, point 2): ``show``, ``show --format json``,
``report`` (terminal, report.md, report.html) open with the run's health (alerts with
rule, step, layer and value; whether attention collapsed; losses; largest logit per
layer), the paper's claims after and only where measurable. On the session's smoke run
(healthy) and a copy with a planted collapse in one layer from step 20."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qkgeom.analysis.health import run_health
from qkgeom.io import write_json, write_parquet
from qkgeom.runs import read_metrics

from .conftest import invoke

LAYER, FROM = 1, 20


@pytest.fixture(scope="module")
def collapsed(smoke_run, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smoke run with layer 1's attention collapsed from step 20: mean entropy
    0.05 nats, normalised 0.01, largest weight 0.99, largest logit 900."""
    run = tmp_path_factory.mktemp("health") / "collapsed"
    shutil.copytree(smoke_run.path, run,
                    ignore=shutil.ignore_patterns("tensorboard", "checkpoints"))
    m = read_metrics(run)
    late = (m["layer"] == LAYER) & (m["step"] >= FROM)
    for metric, value in (("attn_entropy", 0.05), ("attn_entropy_norm", 0.01),
                          ("attn_max", 0.99), ("logit_max", 900.0)):
        m.loc[late & (m["metric"] == metric), "value"] = value
    write_parquet(run / "metrics.parquet", m)
    return run


def test_a_healthy_run_says_so_first(smoke_run) -> None:
    h = run_health(smoke_run.path)
    assert not h.collapsed and h.alerts == [] and h.alerts_from == "replayed"
    assert h.state == "done" and h.last_probe == 40 and h.losses["loss_step"] == 40
    m = read_metrics(smoke_run.path)
    last = m[(m["step"] == 40) & (m["head"] == -1) & (m["metric"] == "logit_max")]
    assert [r["logit_max"] for r in h.layers] == pytest.approx(
        last.sort_values("layer")["value"].tolist())
    out = invoke("show", str(smoke_run.path)).stdout
    assert out.splitlines()[0] == "health: no collapse, no alerts (done at step 40)"
    assert out.index("largest logit per layer") < out.index("per-layer Q/K geometry")


def test_a_planted_collapse_leads_show_with_its_alerts(collapsed: Path) -> None:
    out = invoke("show", str(collapsed), columns=200).stdout
    lines = out.splitlines()
    assert lines[0].startswith("health: COLLAPSED, 2 alert(s)")
    assert (f"alert 'normalised attention entropy fell below 0.065' (attn_entropy_norm "
            f"below 0.065), 1×: step {FROM} layer {LAYER} = 0.01") in out
    assert (f"alert 'attention peaked above 0.92' (attn_max above 0.92), 1×: step {FROM} "
            f"layer {LAYER} = 0.99") in out
    assert "L1 900 (collapsed)" in out and "the default rules replayed" in out
    doc = json.loads(invoke("show", str(collapsed), "--format", "json").stdout)
    health = doc["health"]
    assert health["collapsed"] is True and health["alerts_from"] == "replayed"
    assert [(a["step"], a["layer"], a["metric"]) for a in health["alerts"]] == [
        (FROM, LAYER, "attn_entropy_norm"), (FROM, LAYER, "attn_max")]
    assert [r["collapsed"] for r in health["layers"]] == [r == LAYER for r in range(2)]


def test_a_monitors_recorded_alerts_are_the_ones_shown(collapsed: Path, tmp_path: Path) -> None:
    run = shutil.copytree(collapsed, tmp_path / "monitored")
    write_json(run / "alerts.json", [{"rule": "my rule", "metric": "logit_max", "step": 35,
                                      "layer": 0, "head": 2, "value": 120.0,
                                      "threshold": 100.0, "direction": "above"}])
    h = run_health(run)
    assert h.alerts_from == "recorded" and [a["rule"] for a in h.alerts] == ["my rule"]
    out = invoke("show", str(run), columns=200).stdout
    assert "alert 'my rule' (logit_max above 100), 1×: step 35 layer 0 head 2 = 120" in out
    assert "recorded by the run's monitor" in out


def test_the_report_of_one_run_opens_with_its_health(collapsed: Path, tmp_path: Path) -> None:
    res = invoke("report", str(collapsed), "--out", str(tmp_path / "r"), columns=160)
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].startswith("health: COLLAPSED, 2 alert(s)")
    assert res.stdout.index("health:") < res.stdout.index("claims")
    md = (tmp_path / "r" / "report.md").read_text()
    assert md.index("## Health") < md.index("## The paper's claims")
    assert "**attention collapsed**" in md and "| 1 | 0.05 | 900 | **yes** |" in md
    html = (tmp_path / "r" / "report.html").read_text()
    assert html.index("Health") < html.index("The paper")
    doc = json.loads(invoke("report", str(collapsed), "--out", str(tmp_path / "j"),
                            "--format", "json").stdout)
    assert doc["health"]["collapsed"] is True and len(doc["health"]["alerts"]) == 2


def test_a_long_alert_list_is_cut_with_its_count(collapsed: Path, tmp_path: Path) -> None:
    """A deep model may fire in every layer: the terminal lists 8 firings per rule, the
    report 20 rows, each saying how many there are."""
    from qkgeom.analysis.health import health_lines, health_markdown

    run = shutil.copytree(collapsed, tmp_path / "many")
    write_json(run / "alerts.json", [
        {"rule": "peak", "metric": "attn_max", "step": 5 * i, "layer": i % 4, "head": -1,
         "value": 0.95, "threshold": 0.92, "direction": "above"} for i in range(25)])
    h = run_health(run)
    line = next(x for x in health_lines(h) if "alert 'peak'" in x)
    assert "25×" in line and line.count("step ") == 8 and line.endswith("… 17 more")
    md = health_markdown(h)
    assert md.count("| peak |") == 20 and "The first 20 of 25 alerts" in md
