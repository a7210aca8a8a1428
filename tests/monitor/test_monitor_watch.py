"""``qkgeom watch``: the per-layer table of the latest probe, from the run folder alone."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from qkgeom.errors import QKGeomError
from qkgeom.io import write_json, write_parquet
from qkgeom.monitor.watch import latest_layers, watch


def metrics(level: str = "token") -> pd.DataFrame:
    rows = []
    for step, shift in ((0, 0.0), (10, 1.0)):
        for layer in (0, 1):
            q, k = 8.0 + layer + shift, 5.0 - shift
            rows += [(step, layer, -1, f"pr_q_{level}", q), (step, layer, -1, f"pr_k_{level}", k),
                     (step, layer, -1, f"contrast_{level}", q - k),
                     (step, layer, -1, "attn_entropy", 2.0 - shift / 2),
                     (step, layer, 0, f"pr_q_{level}", 99.0)]  # a head row: not shown
        rows.append((step, -1, -1, "ctl_pr_l0", 3.0))  # controller row: not a layer
    frame = pd.DataFrame(rows, columns=["step", "layer", "head", "metric", "value"])
    return frame.assign(run_id="r")


def test_latest_layers_values_and_changes() -> None:
    step, table = latest_layers(metrics())
    assert step == 10 and list(table.index) == [0, 1]
    assert table.loc[1, "PR_Q"] == 10.0 and table.loc[1, "PR_K"] == 4.0
    assert table.loc[0, "contrast"] == 5.0 and table.loc[0, "entropy"] == 1.5
    assert table.loc[0, "ΔPR_Q"] == 1.0 and table.loc[0, "ΔPR_K"] == -1.0
    assert table.loc[0, "Δentropy"] == -0.5 and table.attrs["level"] == "token"
    _, weight = latest_layers(metrics("weight"))  # a run without token metrics
    assert weight.attrs["level"] == "weight" and weight.loc[1, "PR_Q"] == 10.0


def test_watch_once_cli(tmp_path) -> None:
    from qkgeom.cli import app

    metrics().to_parquet(tmp_path / "metrics.parquet")
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "step": 12,
                                                      "steps": 100}))
    res = CliRunner().invoke(app, ["watch", str(tmp_path), "--once"])
    assert res.exit_code == 0, res.output
    assert "probe at step 10" in res.output and "step 12/100, running" in res.output
    assert "10.000" in res.output and "+1.000" in res.output


def test_watch_live_waits_then_returns_when_the_run_is_done(tmp_path, monkeypatch) -> None:
    """The live view shows the run without a probe while it has none, picks up the first
    probe written while it waits, and returns by itself at "done". The training side
    writes during watch's first wait (its sleep is replaced), so the order is fixed, not
    timed."""
    import types

    from rich.console import Console

    import qkgeom.monitor.watch as watch_mod
    from qkgeom.runs import RunLock

    writer = RunLock(tmp_path)  # a writer holds the run until it has recorded its end
    assert writer.acquire()
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "step": 0}))
    console = Console(record=True, width=150, force_terminal=False)
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # the "training" side: first probe, then done
        waits.append(seconds)
        if len(waits) == 1:
            write_parquet(tmp_path / "metrics.parquet", metrics())  # atomic, as a trainer
            write_json(tmp_path / "status.json", {"state": "done", "step": 3, "steps": 3})
            writer.release()

    shown: list[str] = []  # what each refresh showed: the state, and whether a probe
    render = watch_mod.render

    def spy(run, metrics, status):
        shown.append(f"{status.get('state')}, {'no probe' if metrics is None else 'probe'}")
        return render(run, metrics, status)

    monkeypatch.setattr(watch_mod, "time", types.SimpleNamespace(sleep=sleep))
    monkeypatch.setattr(watch_mod, "render", spy)
    watch(tmp_path, interval=0.05, console=console)  # returns by itself at "done"
    assert waits == [0.05]  # one wait: the run ended during it, and watch returned
    assert shown[0] == shown[-2] == "running, no probe" and shown[-1] == "done, probe"
    text = console.export_text()
    assert "probe at step 10" in text and "step 3/3, done" in text


def test_watch_errors(tmp_path) -> None:
    with pytest.raises(QKGeomError, match="no such run folder"):
        watch(tmp_path / "missing", once=True)
    with pytest.raises(QKGeomError, match="not a run folder"):
        watch(tmp_path, once=True)
