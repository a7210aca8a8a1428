"""Attack 7: writing into folders qkgeom does not own. ``--resume``, ``data prepare``,
checkpoint rotation, temp-file cleanup, grid names and ``report --out`` never overwrite,
delete or escape into what qkgeom did not write; each refusal is one line, exit 2, and the
user's files are byte-for-byte what they were."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fault_helpers import (
    assert_clean_error,
    assert_same_results,
    cli,
    figure,
    in_process,
    status,
    train_args,
    train_in_process,
)

STEPS, EVERY = 8, 4
RESULTS: dict[str, bool] = {}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def base_run(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_in_process(sample_data, tmp_path_factory.mktemp("own") / "base", STEPS, EVERY,
                            keep_checkpoints=3)


@pytest.mark.parametrize("case", ["user status.json", "user .tmp file", "data folder",
                                  "foreign config.json"])
def test_resume_refuses_a_folder_qkgeom_did_not_write(
        sample_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        case: str) -> None:
    out = tmp_path / "theirs"
    if case == "data folder":
        shutil.copytree(sample_data, out)
    else:
        out.mkdir()
        (out / "status.json").write_text('{"mine": "do not touch"}')
        if case == "user .tmp file":
            (out / "status.json").unlink()
            (out / "notes.tmp").write_text("draft")
            (out / ".status.json.tmp").write_text("almost ours, not quite")
        if case == "foreign config.json":
            (out / "config.json").write_text('{"model_type": "gpt2"}')
    before = _files(out)
    code, _, err = in_process([*train_args(sample_data, out, STEPS, EVERY), "--resume"], capsys)
    words = ("not a qkgeom run record",) if case == "foreign config.json" else \
        ("holds files qkgeom did not write",)
    assert_clean_error(code, err, words=(str(out), *words))
    assert _files(out) == before  # nothing overwritten, deleted or added
    RESULTS[f"--resume into a {case}"] = True


def test_resume_keeps_a_users_tmp_files_and_deletes_only_its_own(
        sample_data: Path, base_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    ours = [run / ".metrics.parquet.ab12cd_9.tmp",
            run / "checkpoints" / ".ckpt_00000012.pt.x1y2z3w4.tmp"]
    for p in ours:
        p.write_bytes(b"torn")
    theirs = [run / "checkpoints" / "notes.tmp", run / "checkpoints" / ".ckpt_00000012.pt.tmp"]
    # Not qkgeom's names (a user's file next to ours) must survive the resume's cleanup; a
    # folder with them is still refused on its top level, so they sit inside checkpoints/.
    for p in theirs:
        p.write_text("mine")
    (run / "status.json").write_text(json.dumps({"state": "running", "step": 4}))
    res = cli(*train_args(sample_data, run, STEPS, EVERY, "--set", "keep_checkpoints=3"),
              "--resume")
    assert res.returncode == 0, res.stderr
    assert not any(p.exists() for p in ours)
    assert all(p.read_text() == "mine" for p in theirs)
    RESULTS["temp-file cleanup: exact names only"] = True


def test_rotation_deletes_only_exact_checkpoint_names(sample_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "rot"
    res = cli(*train_args(sample_data, out, 4, 4))
    assert res.returncode == 0, res.stderr
    keep = {"best-ckpt_00000010.pt": b"best", "ckpt_00000004.pt.bak": b"bak",
            "ckpt_0000004.pt": b"seven digits", "my_ckpt_00000008.pt": b"mine"}
    for name, data in keep.items():
        (out / "checkpoints" / name).write_bytes(data)
    (out / "status.json").write_text(json.dumps({"state": "running", "step": 4}))
    res = cli(*train_args(sample_data, out, 12, 4, "--set", "keep_checkpoints=1"), "--resume")
    # steps changed (4 -> 12): refused, and the refusal says why
    assert_clean_error(res.returncode, res.stderr, words=("steps: 4 -> 12", "--steps 4",
                                                          "cannot be lengthened"))
    out2 = tmp_path / "rot2"
    res = cli(*train_args(sample_data, out2, 12, 4, "--set", "keep_checkpoints=1"),
              fault="kill:ckpt_*.pt:2")
    assert res.returncode == -9
    for name, data in keep.items():
        (out2 / "checkpoints" / name).write_bytes(data)
    res = cli(*train_args(sample_data, out2, 12, 4, "--set", "keep_checkpoints=1"), "--resume")
    assert res.returncode == 0, res.stderr
    left = sorted(p.name for p in (out2 / "checkpoints").iterdir())
    assert left == sorted([*keep, "ckpt_00000012.pt"])  # rotation ran (4 and 8 are gone)
    assert all((out2 / "checkpoints" / n).read_bytes() == d for n, d in keep.items())
    RESULTS["checkpoint rotation: exact names only"] = True
    RESULTS["longer --steps on resume: refused with the reason"] = True


def test_resume_refuses_a_replaced_corpus_with_the_same_vocabulary(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "".join(chr(97 + (i * 7) % 26) + (" " if i % 5 == 0 else "") for i in range(9000))
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text(text[::-1])  # the same characters, other text
    data = tmp_path / "data"
    assert cli("data", "prepare", "--dir", str(data), "--source", "text", "--path",
               str(tmp_path / "a.txt")).returncode == 0
    run = tmp_path / "run"
    res = cli(*train_args(data, run, 12, 4), fault="kill:ckpt_*.pt:2")
    assert res.returncode == -9
    meta = data / "meta.json"
    vocab_before = json.loads(meta.read_text())["vocab"]
    res = cli("data", "prepare", "--dir", str(data), "--source", "text", "--path",
              str(tmp_path / "b.txt"))
    assert_clean_error(res.returncode, res.stderr, words=(str(data), "--force"))
    res = cli("data", "prepare", "--dir", str(data), "--source", "text", "--path",
              str(tmp_path / "b.txt"), "--force")
    assert res.returncode == 0, res.stderr
    assert json.loads(meta.read_text())["vocab"] == vocab_before  # same vocabulary: the trap
    code, _, err = in_process([*train_args(data, run, 12, 4), "--resume"], capsys)
    assert_clean_error(code, err, words=(str(meta), "not the one this run was trained on"))
    RESULTS["data prepare over another corpus"] = True
    RESULTS["resume on a replaced corpus (same vocabulary)"] = True


def test_data_prepare_refuses_foreign_files_and_force_keeps_them(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("hello world, " * 400)
    target = tmp_path / "mine"
    target.mkdir()
    (target / "meta.json").write_text('{"my": "own meta"}')
    (target / "thesis.tex").write_text("do not delete")
    before = _files(target)
    res = cli("data", "prepare", "--dir", str(target), "--source", "text", "--path",
              str(tmp_path / "c.txt"))
    assert_clean_error(res.returncode, res.stderr, words=(str(target), "thesis.tex"))
    assert _files(target) == before
    res = cli("data", "prepare", "--dir", str(target), "--source", "text", "--path",
              str(tmp_path / "c.txt"), "--force")
    assert res.returncode == 0, res.stderr
    assert (target / "thesis.tex").read_text() == "do not delete"
    again = cli("data", "prepare", "--dir", str(target), "--source", "text", "--path",
                str(tmp_path / "c.txt"), "--force")
    assert again.returncode == 0
    same = tmp_path / "same"
    for _ in range(2):  # preparing the same corpus again into its own folder is fine
        res = cli("data", "prepare", "--dir", str(same), "--source", "text", "--path",
                  str(tmp_path / "c.txt"))
        assert res.returncode == 0, res.stderr
    RESULTS["data prepare into a folder with foreign files"] = True


@pytest.mark.parametrize("name", ["../escaped", "/abs/sweep", "..", "a\\b"])
def test_grid_names_cannot_leave_sweeps(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"name": name, "preset": "smoke"}))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code, _, err = in_process(["sweep", "run", str(grid), "--quiet"], capsys)
    assert_clean_error(code, err, words=("grid name", "not a folder name"))
    assert set(tmp_path.iterdir()) == {grid, work} and not any(work.iterdir())
    RESULTS[f"grid name {name!r}"] = True


def test_grid_name_with_spaces_becomes_a_safe_folder() -> None:
    from qkgeom.experiments.grid import Grid

    grid = Grid.from_dict({"name": "my grid <1>", "preset": "smoke"})
    assert grid.name == "my grid <1>" and grid.folder_name == "my_grid__1_"


def test_report_out_refuses_a_folder_it_did_not_write(base_run: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    theirs = tmp_path / "paper"
    theirs.mkdir()
    # qkgeom's heading and an HTML beside it, but no report.json: not a report folder
    (theirs / "report.md").write_text("# qkgeom report: my own notes\n")
    (theirs / "report.html").write_text("<p>mine</p>\n")
    before = _files(theirs)
    code, _, err = in_process(["report", str(base_run), "--out", str(theirs)], capsys)
    assert_clean_error(code, err, words=(str(theirs), "not a qkgeom report folder"))
    assert _files(theirs) == before
    out = tmp_path / "rep"
    for _ in range(2):  # its own report folder may be written again
        code, _, err = in_process(["report", str(base_run), "--out", str(out)], capsys)
        assert code == 0, err
    assert json.loads((out / "report.json").read_text())["kind"] == "qkgeom-report"
    RESULTS["report --out into a foreign folder"] = True
    figure("data safety", f"{sum(RESULTS.values())}/{len(RESULTS)} cases handled cleanly "
           f"({'; '.join(RESULTS)})")


def test_an_interrupted_sweep_run_without_config_resumes(sample_data: Path, base_run: Path,
                                                         tmp_path: Path) -> None:
    """A sweep's run folder holding only the sweep's own files (worker.log, attempts, a
    failed status) is qkgeom's: resuming it trains, as before."""
    run = tmp_path / "sweep" / "runs" / "r"
    run.mkdir(parents=True)
    (run / "worker.log").write_text("")
    (run / "attempts.jsonl").write_text("{}\n")
    (run / "status.json").write_text(json.dumps({"state": "failed", "step": 0, "steps": 8,
                                                 "error": "worker died"}))
    res = cli(*train_args(sample_data, run, STEPS, EVERY), "--resume")
    assert res.returncode == 0, res.stderr
    assert status(run)["state"] == "done"
    assert_same_results(base_run, run)
