"""Attack 9: durability and scale of the run folder. Tables grow by parts and are compacted
at the end: a run killed between compactions has every probe it wrote visible to ``show``,
``watch``, collation and reports; a flush writes the same few rows at the thousandth probe
as at the first; renames are made durable (the folder is fsynced); the thread count is
recorded and a resume that changes it says so."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
from fault_helpers import cli, figure, in_process, status, train_args

from qkgeom.runs import METRIC_COLUMNS, RunWriter, read_log, read_metrics
from qkgeom.runs.table import FAN_IN, list_parts, parts_dir

RESULTS: dict[str, bool] = {}


def _probe_rows(step: int, value: float = 1.0) -> pd.DataFrame:
    return pd.DataFrame({"layer": [0, 0, 1], "head": [-1, 0, -1],
                         "metric": ["pr_q_token"] * 3, "value": [value, value + 1, value + 2]})


@pytest.fixture(scope="module")
def killed(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 16-step run SIGKILLed half-way through writing the rows of its step-12 probe
    (the 7th part), before any compaction."""
    out = tmp_path_factory.mktemp("io") / "run"
    res = cli(*train_args(sample_data, out, 16, 4), fault="kill:p*-L0.parquet:7")
    assert res.returncode == -9, res.stderr
    return out


def test_readers_see_every_probe_of_a_run_killed_between_compactions(
        killed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qkgeom.analysis import collate

    assert not (killed / "metrics.parquet").exists()  # killed before any compaction
    assert list(parts_dir(killed / "metrics.parquet").glob(".*.tmp"))  # ... mid-write
    assert sorted(read_metrics(killed)["step"].unique()) == [0, 4, 8]
    assert sorted(read_log(killed)["step"].unique()) == [0, 4, 8]
    code, out, err = in_process(["show", str(killed)], capsys)
    assert code == 0 and "at step 8" in " ".join(out.split()), err  # the title may wrap
    code, out, err = in_process(["watch", str(killed), "--once"], capsys)
    assert code == 0 and "probe at step 8" in out.replace("\n", " "), err
    table = collate(killed, include_incomplete=True).metrics
    assert sorted(table["step"].unique()) == [0, 4, 8]
    RESULTS["readers of a run killed between compactions"] = True


def test_report_of_a_run_killed_between_compactions(killed: Path, tmp_path: Path) -> None:
    import shutil

    from qkgeom.analysis import write_report

    run = tmp_path / "run"
    shutil.copytree(killed, run)
    md = write_report(run, tmp_path / "rep", figures=False, include_incomplete=True).read_text()
    assert "left out (below)" not in md and "analysed" in md
    RESULTS["report of a run killed between compactions"] = True


def test_resume_compacts_and_finishes_bit_exact(sample_data: Path, killed: Path,
                                                tmp_path: Path) -> None:
    import shutil

    from fault_helpers import assert_same_results, train_in_process

    run = tmp_path / "run"
    shutil.copytree(killed, run)
    res = cli(*train_args(sample_data, run, 16, 4), "--resume")
    assert res.returncode == 0, res.stderr
    assert not parts_dir(run / "metrics.parquet").exists()  # compacted at the end
    assert_same_results(train_in_process(sample_data, tmp_path / "ref", 16, 4), run)


def test_a_run_is_never_done_before_its_tables_are_compacted(sample_data: Path,
                                                            tmp_path: Path) -> None:
    """SIGKILL in the middle of the final compaction: the status must not say ``done``
    yet (a sweep skips done runs, and readers of plain Parquet would miss rows); the
    resume finishes it bit-exact, with complete plain files."""
    from fault_helpers import assert_same_results, train_in_process

    run = tmp_path / "run"
    res = cli(*train_args(sample_data, run, 16, 4), fault="kill:metrics.parquet:1")
    assert res.returncode == -9, res.stderr  # killed while compacting, at the very end
    assert status(run)["state"] == "running" and status(run)["step"] == 12
    res = cli(*train_args(sample_data, run, 16, 4), "--resume")
    assert res.returncode == 0, res.stderr
    assert_same_results(train_in_process(sample_data, tmp_path / "ref", 16, 4), run)
    RESULTS["killed during the final compaction"] = True


def test_a_flush_writes_only_the_new_rows_and_parts_stay_few(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path, "r")
    sizes, counts = [], []
    n = 3 * FAN_IN ** 2 // 2  # enough flushes for two merge levels
    for step in range(n):
        writer.add_metrics(_probe_rows(step, float(step)), step)
        writer.add_log({"step": step, "loss": 1.0 / (step + 1)})
        writer.flush()
        newest = max(list_parts(tmp_path / "metrics.parquet"))
        if newest[1] == 0:  # a plain flush: the part holds this probe's rows only
            sizes.append(len(pd.read_parquet(newest[2])))
        counts.append(len(list_parts(tmp_path / "metrics.parquet")))
    assert set(sizes) == {3}
    assert max(counts) <= 3 * FAN_IN  # O(FAN_IN · levels) files, not one per probe
    assert {lv for _, lv, _ in list_parts(tmp_path / "metrics.parquet")} >= {1, 2}
    expected = writer.metrics
    pd.testing.assert_frame_equal(read_metrics(tmp_path)[METRIC_COLUMNS], expected)
    writer.compact()
    assert not parts_dir(tmp_path / "metrics.parquet").exists()
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "metrics.parquet"), expected)
    assert len(read_log(tmp_path)) == n
    RESULTS["flush size independent of run length"] = True


def test_a_replaced_probe_replaces_its_rows_in_every_reader(tmp_path: Path) -> None:
    """The monitor re-measures a step with ``replace=True``: readers see the new rows only,
    before and after a merge, and after a kill between a merge's write and its deletes."""
    writer = RunWriter(tmp_path, "m")
    path = tmp_path / "metrics.parquet"

    def step3() -> list[float]:
        table = read_metrics(tmp_path)
        return table[table["step"] == 3]["value"].tolist()

    for step in range(FAN_IN - 2):
        writer.add_metrics(_probe_rows(step), step, replace=True)
        writer.flush()
    writer.add_metrics(_probe_rows(3, 99.0), 3, replace=True)
    writer.flush()  # part FAN_IN - 1: no merge yet
    assert step3() == [99.0, 100.0, 101.0] and len(list_parts(path)) == FAN_IN - 1
    writer.add_metrics(_probe_rows(FAN_IN - 2), FAN_IN - 2, replace=True)
    writer.flush()  # part FAN_IN: merged into one level-1 part
    assert [lv for _, lv, _ in list_parts(path)] == [1]
    table = read_metrics(tmp_path)
    assert step3() == [99.0, 100.0, 101.0] and len(table) == 3 * (FAN_IN - 1)
    pd.testing.assert_frame_equal(table[METRIC_COLUMNS], writer.metrics)
    # A merge killed after writing its output, before deleting its inputs: the inputs are
    # back beside it, and the table reads the same.
    def part(seq: int, step: int, value: float = 1.0) -> None:
        rows = _probe_rows(step, value).assign(run_id="m", step=step)[METRIC_COLUMNS]
        rows.to_parquet(parts_dir(path) / f"p{seq:010d}-L0.parquet")

    for step in range(FAN_IN - 2):
        part(step, step)
    part(FAN_IN - 2, 3, 99.0)
    part(FAN_IN - 1, FAN_IN - 2)
    assert len(list_parts(path)) == FAN_IN + 1
    pd.testing.assert_frame_equal(read_metrics(tmp_path), table)
    RESULTS["replaced probes and interrupted merges"] = True


def test_atomic_writes_fsync_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qkgeom.io import write_json

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_json(tmp_path / "a.json", {"x": 1})
    assert synced[-1] == str(tmp_path)  # after the rename, the folder itself
    assert synced[0].startswith(str(tmp_path / ".a.json."))  # before it, the data
    RESULTS["folder fsynced after each rename"] = True


def test_threads_are_recorded_and_a_changed_count_is_warned(sample_data: Path,
                                                            tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = cli(*train_args(sample_data, run, 12, 4), fault="kill:ckpt_*.pt:2")
    assert res.returncode == -9 and status(run)["threads"] == 1
    args = train_args(sample_data, run, 12, 4)
    args[args.index("--threads") + 1] = "2"
    res = cli(*args, "--resume")
    assert res.returncode == 0, res.stderr
    warning = [ln for ln in res.stderr.splitlines() if ln.startswith("qkgeom: warning:")]
    assert len(warning) == 1 and "resuming with 2 torch threads" in warning[0]
    assert "--threads 1" in warning[0] and status(run)["threads"] == 2
    same = cli(*args, "--resume")  # done already, same count: nothing to say
    assert same.returncode == 0 and "warning" not in same.stderr
    RESULTS["thread count recorded, change warned"] = True
    figure("run folder", f"{sum(RESULTS.values())}/{len(RESULTS)} cases handled cleanly "
           f"({'; '.join(RESULTS)})")
