"""Attack group 1: symbolic links planted in a run, sweep or report folder (a folder
someone shared or that was downloaded) to turn qkgeom's own writes against its user.

A lock file, ``attempts.jsonl``, ``worker.log`` or ``report/`` that is a link to a user's
file or folder is refused in one line naming it; the link's target is byte for byte what
it was; and the read-only ``sweep status`` creates, truncates and changes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fault_helpers import (
    assert_clean_error,
    files,
    group_figure,
    in_process,
    status,
    train_args,
    train_in_process,
    tree,
)

STEPS, EVERY = 8, 4
THESIS = "the user's thesis, chapter 3\n"
RESULTS: dict[str, bool] = {}


_figure = group_figure("links", RESULTS)


@pytest.fixture(scope="module")
def base_run(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_in_process(sample_data, tmp_path_factory.mktemp("links") / "base", STEPS,
                            EVERY)


def _victim(folder: Path, name: str = "thesis.txt") -> Path:
    victim = folder / name
    victim.write_text(THESIS)
    return victim


def test_a_lock_file_link_is_refused_and_its_target_kept(
        sample_data: Path, base_run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    victim = _victim(tmp_path)
    (tmp_path / ".run.lock").symlink_to(victim)
    before = files(run)
    code, _, err = in_process([*train_args(sample_data, run, STEPS, EVERY), "--resume"], capsys)
    assert victim.read_text() == THESIS  # not truncated, nothing written into it
    assert_clean_error(code, err, words=(".run.lock", "symbolic link"))
    assert files(run) == before
    RESULTS["lock file -> user file, train --resume"] = True


def _crafted_sweep(base_run: Path, root: Path, victim: Path) -> Path:
    """A sweep folder as one might download it: run r1 ``running`` (so its lock is
    probed) with its lock a link to ``victim``, run r2 never started (no folder, no lock)."""
    sweep = root / "sweep"
    runs = sweep / "runs"
    runs.mkdir(parents=True)
    shutil.copytree(base_run, runs / "r1")
    (runs / "r1" / "status.json").write_text(json.dumps({"state": "running", "step": 4,
                                                         "steps": STEPS}))
    (runs / ".r1.lock").symlink_to(victim)
    entries = [{"run_id": rid, "axes": {"seed": i}, "config_hash": "0" * 12, "steps": STEPS}
               for i, rid in enumerate(("r1", "r2"))]
    (sweep / "sweep.json").write_text(json.dumps({
        "grid": {"name": "crafted", "preset": "smoke", "base": {}, "axes": {"seed": [0, 1]}},
        "runs": entries}))
    return sweep


def test_sweep_status_writes_nothing_and_never_through_a_link(
        base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = _victim(tmp_path)
    sweep = _crafted_sweep(base_run, tmp_path, victim)
    before = tree(tmp_path)
    code, out, err = in_process(["sweep", "status", str(sweep), "--format", "json"], capsys)
    assert code == 0, err
    assert victim.read_text() == THESIS
    assert tree(tmp_path) == before  # no lock created, none truncated, nothing touched
    states = {r["run_id"]: r["state"] for r in json.loads(out)["runs"]}
    assert states == {"r1": "interrupted", "r2": "pending"}
    RESULTS["sweep status on a crafted sweep: read-only"] = True


@pytest.mark.slow
def test_sweep_run_never_appends_through_planted_logs(
        sample_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    grid = tmp_path / "grid.yaml"
    base = {"data": str(sample_data), "steps": 4, "checkpoint_every": 4, "probe_every": 4,
            "eval_every": 4, "log_every": 4, "warmup_steps": 1}
    grid.write_text(yaml.safe_dump({"name": "g", "preset": "smoke", "base": base}))
    sweep = tmp_path / "sweep"
    code, _, err = in_process(["sweep", "run", str(grid), "--out", str(sweep), "--quiet",
                               "--threads", "1"], capsys)
    assert code == 0, err
    run = sweep / "runs" / "base"
    victims = {name: _victim(tmp_path, f"victim-{name}") for name in ("attempts.jsonl",
                                                                      "worker.log")}
    for name, victim in victims.items():
        (run / name).unlink()
        (run / name).symlink_to(victim)
    (run / "status.json").write_text(json.dumps({"state": "running", "step": 0, "steps": 4}))
    before = tree(tmp_path)
    code, _, err = in_process(["sweep", "run", str(grid), "--out", str(sweep), "--quiet",
                               "--threads", "1"], capsys)
    assert all(v.read_text() == THESIS for v in victims.values())  # nothing appended
    assert_clean_error(code, err, words=("symbolic link",))
    assert any(name in err for name in victims)
    assert tree(tmp_path) == before
    assert status(run)["state"] == "running"
    RESULTS["attempts.jsonl / worker.log -> user files, sweep run"] = True


@pytest.mark.parametrize("case", ["link to another report", "dangling link"])
def test_a_report_folder_link_is_refused(base_run: Path, tmp_path: Path, case: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    theirs = tmp_path / "their-report"
    if case == "link to another report":  # the user's own report of another folder
        code, _, err = in_process(["report", str(base_run), "--out", str(theirs)], capsys)
        assert code == 0, err
    (run / "report").symlink_to(theirs, target_is_directory=True)
    before = files(theirs) if theirs.exists() else None
    code, _, err = in_process(["report", str(run)], capsys)
    assert_clean_error(code, err, words=(str(run / "report"), "symbolic link"))
    assert (files(theirs) if theirs.exists() else None) == before
    RESULTS[f"report/ as a {case}"] = True
