"""Attack 2: torn and corrupt files. Each is named in a one-line error with what to do (or
the previous checkpoint is used), never a traceback and never a silently wrong result."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fault_helpers import (
    assert_clean_error,
    assert_same_results,
    cli,
    figure,
    in_process,
    status,
    train_args,
    train_in_process,
    tree,
)

STEPS, EVERY = 12, 4
RESULTS: dict[str, bool] = {}


@pytest.fixture(scope="module")
def base_run(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 12-step run with checkpoints at 4, 8 and 12."""
    out = tmp_path_factory.mktemp("corrupt") / "base"
    return train_in_process(sample_data, out, STEPS, EVERY, keep_checkpoints=3)


def _copy(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _resume_args(data: Path, run: Path) -> list[str]:
    return [*train_args(data, run, STEPS, EVERY, "--set", "keep_checkpoints=3"), "--resume"]


def _interrupted(run: Path) -> None:
    """Make the finished run look killed before its last checkpoint completed."""
    (run / "status.json").write_text(json.dumps({"state": "running", "step": 8}))


def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(
        sample_data: Path, base_run: Path, tmp_path: Path) -> None:
    run = _copy(base_run, tmp_path)
    _truncate(run / "checkpoints" / "ckpt_00000012.pt")
    _interrupted(run)
    res = cli(*_resume_args(sample_data, run))  # a subprocess: warnings reach stderr
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    warning = [ln for ln in res.stderr.splitlines() if "ckpt_00000012.pt" in ln]
    assert len(warning) == 1 and warning[0].startswith("qkgeom: warning:")
    assert "falling back" in warning[0]
    assert status(run)["state"] == "done"
    assert_same_results(base_run, run)  # retrained 8 -> 12: the same bits
    RESULTS["truncated newest checkpoint"] = True


def test_every_checkpoint_torn_is_an_error_not_a_silent_restart(
        sample_data: Path, base_run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(base_run, tmp_path)
    for ckpt in (run / "checkpoints").glob("ckpt_*.pt"):
        _truncate(ckpt)
    _interrupted(run)
    code, _, err = in_process(_resume_args(sample_data, run), capsys)
    assert_clean_error(code, err, words=("checkpoints", "no readable checkpoint"))
    RESULTS["all checkpoints torn"] = True


@pytest.mark.parametrize("name", ["metrics.parquet", "train_log.parquet"])
def test_truncated_parquet_is_named(sample_data: Path, base_run: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str], name: str) -> None:
    run = _copy(base_run, tmp_path)
    _truncate(run / name)
    _interrupted(run)
    code, _, err = in_process(_resume_args(sample_data, run), capsys)
    assert_clean_error(code, err, words=(name, "unreadable"))
    if name == "metrics.parquet":
        code, _, err = in_process(["show", str(run)], capsys)
        assert_clean_error(code, err, words=(name,))
    RESULTS[f"truncated {name}"] = True


@pytest.mark.parametrize("garbage", [b"\x00\xff garbage {", b"[1, 2]", b'{"started": "x"}'])
def test_status_json_garbage_is_rewritten_on_resume(
        sample_data: Path, base_run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], garbage: bytes) -> None:
    run = _copy(base_run, tmp_path)
    (run / "status.json").write_bytes(garbage)
    code, _, err = in_process(_resume_args(sample_data, run), capsys)
    assert code == 0, err
    assert status(run)["state"] == "done"
    assert_same_results(base_run, run)
    RESULTS[f"status.json {garbage[:8]!r}"] = True


@pytest.mark.parametrize("version, words", [
    (99, "upgrade qkgeom"), (0, "train it again"),
    # formats 1-3 (older key-control keys) are not migrated: refused, saying what to do
    (2, "older qkgeom"), (3, "train it again with this version")])
def test_run_folder_of_another_format_version(
        sample_data: Path, base_run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], version: int, words: str) -> None:
    run = _copy(base_run, tmp_path)
    prov = json.loads((run / "config.json").read_text())
    prov["format_version"] = version
    (run / "config.json").write_text(json.dumps(prov))
    before = tree(run)
    for args in (_resume_args(sample_data, run), ["show", str(run)]):
        code, _, err = in_process(args, capsys)
        assert_clean_error(code, err, words=("config.json", f"format {version}", words))
    assert tree(run) == before  # nothing written
    RESULTS[f"run folder format {version}"] = True


def test_checkpoint_of_a_newer_format_is_an_error(
        sample_data: Path, base_run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(base_run, tmp_path)
    path = run / "checkpoints" / "ckpt_00000012.pt"
    state = torch.load(path, weights_only=False)
    state["format_version"] = 2
    torch.save(state, path)
    _interrupted(run)
    code, _, err = in_process(_resume_args(sample_data, run), capsys)
    assert_clean_error(code, err, words=("ckpt_00000012.pt", "upgrade qkgeom"))
    RESULTS["checkpoint format 2"] = True


def test_meta_json_vocabulary_that_does_not_match_the_run(
        sample_data: Path, base_run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Same vocabulary size, different characters: the config hash cannot tell."""
    run = _copy(base_run, tmp_path)
    _interrupted(run)
    data = tmp_path / "data"
    shutil.copytree(sample_data, data)
    meta = json.loads((data / "meta.json").read_text())
    chars = meta["vocab"]["chars"]
    new = next(c for c in map(chr, range(0x4E00, 0x9FFF)) if c not in chars)
    meta["vocab"]["chars"] = "".join(sorted(chars[:-1] + new))
    (data / "meta.json").write_text(json.dumps(meta))
    code, _, err = in_process(_resume_args(data, run), capsys)
    assert_clean_error(code, err, words=(str(data / "meta.json"), "vocabulary"))
    RESULTS["meta.json vocabulary mismatch"] = True


def test_report_lists_corrupt_runs_and_goes_on(base_run: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from qkgeom.analysis import runs_table

    sweep = tmp_path / "sweep"
    for name in ("good", "torn_metrics", "torn_status", "future", "torn_log"):
        shutil.copytree(base_run, sweep / "runs" / name)
        prov = json.loads((sweep / "runs" / name / "config.json").read_text())
        (sweep / "runs" / name / "config.json").write_text(json.dumps({**prov, "run_id": name}))
    _truncate(sweep / "runs" / "torn_metrics" / "metrics.parquet")
    (sweep / "runs" / "torn_status" / "status.json").write_text("{oops")
    _truncate(sweep / "runs" / "torn_log" / "train_log.parquet")
    prov = json.loads((sweep / "runs" / "future" / "config.json").read_text())
    (sweep / "runs" / "future" / "config.json").write_text(
        json.dumps({**prov, "format_version": 99}))
    from qkgeom.analysis import collate

    data = collate(sweep)
    excluded = dict(zip(data.excluded["run_id"], data.excluded["excluded"], strict=True))
    assert set(excluded) == {"torn_metrics", "torn_status", "future", "torn_log"}, excluded
    assert set(data.metrics["run_id"]) == {"good"}
    assert "unreadable" in excluded["torn_status"] and "format 99" in excluded["future"]
    assert len(runs_table(sweep)) == 5
    RESULTS["corrupt runs in a report"] = True
    figure("torn/corrupt files", f"{sum(RESULTS.values())}/{len(RESULTS)} cases handled "
           f"cleanly ({'; '.join(RESULTS)})")
