"""Attack group 4: files that parse but hold the wrong types. Every run-folder file is
checked against its schema when read: ``show``, ``watch``, ``report``, ``sweep status``
and ``train --resume`` stop in one line naming the file (a finished run stays ``done``),
and in a sweep the bad run is listed as unreadable while the rest is reported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from fault_helpers import (
    assert_clean_error,
    files,
    group_figure,
    in_process,
    status,
    train_args,
    train_in_process,
)

STEPS, EVERY = 8, 4
RESULTS: dict[str, bool] = {}


_figure = group_figure("typed reads", RESULTS)


@pytest.fixture(scope="module")
def base_run(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_in_process(sample_data, tmp_path_factory.mktemp("typed") / "base", STEPS,
                            EVERY)


def _value_as_text(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(value=frame["value"].astype(str))


def _step_as_text(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(step=frame["step"].astype(str))


def _nan_layer(frame: pd.DataFrame) -> pd.DataFrame:
    layer = frame["layer"].astype(float)
    layer.iloc[0] = float("nan")
    return frame.assign(layer=layer)


METRICS = {"value stored as text": _value_as_text, "step stored as text": _step_as_text,
           "a NaN layer": _nan_layer}
COMMANDS = {"show": lambda run, data: ["show", str(run)],
            "watch": lambda run, data: ["watch", str(run), "--once"],
            "report": lambda run, data: ["report", str(run)],
            "train --resume": lambda run, data: [*train_args(data, run, STEPS, EVERY),
                                                 "--resume"]}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(METRICS))
def test_metrics_of_the_wrong_types_are_one_line_naming_the_file(
        sample_data: Path, base_run: Path, tmp_path: Path, case: str, command: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    path = run / "metrics.parquet"
    METRICS[case](pd.read_parquet(path)).to_parquet(path, index=False)
    before = {k: v for k, v in files(run).items() if not k.startswith("report")}
    code, _, err = in_process(COMMANDS[command](run, sample_data), capsys)
    assert_clean_error(code, err, words=(str(path),))
    assert status(run)["state"] == "done"  # a resume turned it into "failed" before
    assert {k: v for k, v in files(run).items() if not k.startswith("report")} == before
    RESULTS[f"metrics.parquet {case}: {command}"] = True


def test_alerts_that_are_not_a_list_are_one_line(base_run: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    (run / "alerts.json").write_text("5")
    code, _, err = in_process(["watch", str(run), "--once"], capsys)
    assert_clean_error(code, err, words=(str(run / "alerts.json"), "alerts"))
    RESULTS["alerts.json = 5: watch"] = True


def _sweep(base_run: Path, root: Path, n: int = 2) -> Path:
    """A sweep folder of ``n`` finished runs r0, r1 ... (copies of one run, renamed)."""
    sweep = root / "sweep"
    entries = []
    for i in range(n):
        folder = sweep / "runs" / f"r{i}"
        shutil.copytree(base_run, folder)
        record = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**record, "run_id": f"r{i}"}))
        entries.append({"run_id": f"r{i}", "axes": {"seed": i},
                        "config_hash": record["config_hash"], "steps": STEPS})
    (sweep / "sweep.json").write_text(json.dumps({
        "grid": {"name": "typed", "preset": "smoke", "base": {},
                 "axes": {"seed": list(range(n))}}, "runs": entries}))
    return sweep


@pytest.mark.parametrize(("record", "command"), [("[]", "report"),
                                                ('{"runs": [5]}', "sweep status")])
def test_a_sweep_record_of_the_wrong_shape_is_one_line(
        base_run: Path, tmp_path: Path, record: str, command: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    sweep = _sweep(base_run, tmp_path)
    (sweep / "sweep.json").write_text(record)
    code, _, err = in_process([*command.split(), str(sweep)], capsys)
    assert_clean_error(code, err, words=(str(sweep / "sweep.json"),))
    RESULTS[f"sweep.json = {record}: {command}"] = True


def test_a_status_step_that_is_a_word_lists_that_run_as_unreadable(
        base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = _sweep(base_run, tmp_path)
    bad = sweep / "runs" / "r1" / "status.json"
    bad.write_text(json.dumps({**json.loads(bad.read_text()), "step": "eight"}))
    code, out, err = in_process(["sweep", "status", str(sweep), "--format", "json"], capsys)
    assert code == 0, err
    runs = {r["run_id"]: r for r in json.loads(out)["runs"]}
    assert runs["r0"]["state"] == "done"
    assert runs["r1"]["state"] == "unreadable" and str(bad) in runs["r1"]["error"]
    RESULTS["status.json step 'eight': sweep status"] = True


def test_one_run_with_a_mistyped_config_never_sinks_the_report(
        base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = _sweep(base_run, tmp_path, n=3)
    bad = sweep / "runs" / "r1" / "config.json"
    record = json.loads(bad.read_text())
    record["config"]["warmup_steps"] = "five"
    bad.write_text(json.dumps(record))
    code, _, err = in_process(["report", str(sweep)], capsys)
    assert code == 0, err
    report = sweep / "report"
    assert json.loads((report / "report.json").read_text())["excluded"] == 1
    text = (report / "report.md").read_text()
    assert "r1" in text and "unreadable" in text and "warmup" in text
    RESULTS["config.json warmup_steps 'five' in one run of three: report"] = True
