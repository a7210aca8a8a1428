"""Attack group 3: checkpoints that do not belong to the run. A resume loads a checkpoint
only when it is this run's: the config it records has the run's hash (device, threads and
compile aside), its step is within the run's steps, and its RNG and loss states are well
formed. A checkpoint of a longer run, of another config, with a malformed ``data_rng`` or
loss accumulator, a linked ``checkpoints/`` folder or a linked checkpoint file is refused
in one line naming it, before anything is written: the run folder (status included) and
the other run's checkpoints are byte for byte what they were."""

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
    files,
    group_figure,
    in_process,
    status,
    train_args,
    train_in_process,
)

from qkgeom.training.checkpoint import read_checkpoint

STEPS, EVERY = 16, 4
RESULTS: dict[str, bool] = {}


_figure = group_figure("foreign checkpoints", RESULTS)


@pytest.fixture(scope="module")
def interrupted(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 16-step run killed half-way through its step-8 checkpoint (newest: step 4)."""
    out = tmp_path_factory.mktemp("belongs") / "run"
    res = cli(*train_args(sample_data, out, STEPS, EVERY), fault="kill:ckpt_*.pt:2")
    assert res.returncode == -9, res.stderr
    (out / "status.json").write_text(json.dumps({"state": "running", "step": 4,
                                                 "steps": STEPS}))
    return out


def _tamper(run: Path, name: str, change) -> Path:
    """Write ``change(state of ckpt 4)`` as ``checkpoints/<name>`` (weights-only loadable)."""
    state = read_checkpoint(run / "checkpoints" / "ckpt_00000004.pt")
    change(state)
    path = run / "checkpoints" / name
    torch.save(state, path)
    return path


def _longer(state: dict) -> None:
    state["step"] = 24
    state["config"]["steps"] = 24


def _other_seed(state: dict) -> None:
    state["step"] = 12
    state["config"]["seed"] = 7


def _bad_rng(state: dict) -> None:
    state["step"] = 12
    state["data_rng"] = torch.zeros(3, dtype=torch.uint8)


def _bad_loss(state: dict) -> None:
    state["step"] = 12
    state["loss_acc"] = {"loss_sum": "much", "loss_n": 1}


CASES = {
    "a longer run's checkpoint (step 24 of 16)": ("ckpt_00000024.pt", _longer,
                                                  "beyond the run's 16 steps"),
    "another config's checkpoint (seed 7)": ("ckpt_00000012.pt", _other_seed, "another config"),
    "malformed data_rng": ("ckpt_00000012.pt", _bad_rng, "data_rng"),
    "malformed loss accumulator": ("ckpt_00000012.pt", _bad_loss, "loss accumulator"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_that_is_not_the_runs_is_refused_before_any_write(
        sample_data: Path, interrupted: Path, tmp_path: Path, case: str) -> None:
    name, change, why = CASES[case]
    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    _tamper(run, name, change)
    before = files(run)
    # a subprocess with a deadline: before this check, the longer run's checkpoint trained
    # without end
    res = cli(*train_args(sample_data, run, STEPS, EVERY), "--resume", timeout=120)
    assert_clean_error(res.returncode, res.stderr,
                       words=(name, "not a checkpoint of this run", why))
    assert files(run) == before  # status still "running": nothing touched
    RESULTS[case] = True


def test_the_run_resumes_once_the_foreign_file_is_gone(
        sample_data: Path, interrupted: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    path = _tamper(run, "ckpt_00000024.pt", _longer)
    assert cli(*train_args(sample_data, run, STEPS, EVERY), "--resume").returncode == 2
    path.unlink()
    res = cli(*train_args(sample_data, run, STEPS, EVERY), "--resume")
    assert res.returncode == 0, res.stderr
    assert status(run)["state"] == "done"
    assert_same_results(train_in_process(sample_data, tmp_path / "ref", STEPS, EVERY), run)
    RESULTS["resume after removing the foreign checkpoint: bit-exact"] = True


@pytest.mark.parametrize("case", ["checkpoints/ -> another run's", "a checkpoint file -> "
                                  "another run's"])
def test_linked_checkpoints_are_refused_and_the_other_run_is_untouched(
        sample_data: Path, interrupted: Path, tmp_path: Path, case: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    # another run (seed 1) stopped at step 8, its checkpoints 4 and 8 on disk
    other = train_in_process(sample_data, tmp_path / "other", STEPS, EVERY, seed=1,
                             keep_checkpoints=0)
    for step in (12, 16):
        (other / "checkpoints" / f"ckpt_{step:08d}.pt").unlink()
    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    if case.startswith("checkpoints/"):  # a resume through it rotated 4 and 8 away
        shutil.rmtree(run / "checkpoints")
        link = run / "checkpoints"
        link.symlink_to(other / "checkpoints", target_is_directory=True)
    else:  # a resume from it continued the other run's weights
        link = run / "checkpoints" / "ckpt_00000008.pt"
        link.symlink_to(other / "checkpoints" / "ckpt_00000008.pt")
    theirs, before = files(other), files(run)
    code, _, err = in_process([*train_args(sample_data, run, STEPS, EVERY), "--resume"],
                              capsys)
    assert_clean_error(code, err, words=(str(link), "symbolic link"))
    assert files(other) == theirs  # rotation deleted nothing of the other run
    assert files(run) == before
    RESULTS[case] = True
