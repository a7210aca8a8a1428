"""Attack group 2: one writer per *folder*, not per path. ``alias -> runs/a`` and
``runs/a`` name one run folder, so they meet one lock: a resume through the alias while
another process writes the run is refused in one line naming the holder, touches nothing,
and the first writer finishes bit-exact. Synchronised by file flags (the ``pause`` fault),
never by sleeping."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import (
    assert_clean_error,
    assert_same_results,
    cli,
    fault_env,
    group_figure,
    status,
    train_args,
    train_in_process,
    tree,
)

from qkgeom.runs import RunLock

STEPS, EVERY = 8, 4
RESULTS: dict[str, bool] = {}


_figure = group_figure("one lock per folder", RESULTS)


def _aliased(tmp_path: Path) -> tuple[Path, Path]:
    run = tmp_path / "runs" / "a"
    run.parent.mkdir(parents=True)
    alias = tmp_path / "alias"
    alias.symlink_to(run, target_is_directory=True)  # dangling until the run exists
    return run, alias


def test_every_alias_of_a_folder_meets_its_lock(tmp_path: Path) -> None:
    run, alias = _aliased(tmp_path)
    run.mkdir()
    mine = RunLock(run)
    assert mine.acquire()
    try:
        code = (f"from qkgeom.runs import RunLock; import sys; "
                f"sys.exit(0 if RunLock({str(alias)!r}).acquire() else 3)")
        assert subprocess.run([sys.executable, "-c", code]).returncode == 3
    finally:
        mine.release()
    RESULTS["RunLock(alias) while RunLock(folder) is held"] = True


@pytest.mark.slow
def test_a_resume_through_an_alias_is_refused_while_the_run_is_written(
        sample_data: Path, tmp_path: Path) -> None:
    run, alias = _aliased(tmp_path)
    ref = train_in_process(sample_data, tmp_path / "ref", STEPS, EVERY)
    flag = tmp_path / "first"
    env = dict(fault_env("pause:status.json:1"), QKGEOM_FAULT_PAUSE=str(flag))
    first = subprocess.Popen([sys.executable, "-m", "qkgeom.cli",
                              *train_args(sample_data, run, STEPS, EVERY)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not flag.with_name("first.waiting").exists():  # lock held, run under way
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "the first writer never reached its pause"
            time.sleep(0.01)
        before = tree(tmp_path / "runs")
        second = cli(*train_args(sample_data, alias, STEPS, EVERY), "--resume")
        assert_clean_error(second.returncode, second.stderr,
                           words=("another process is writing this run",
                                  f"pid {first.pid} on host {socket.gethostname()}"))
        assert tree(tmp_path / "runs") == before  # the refused writer touched nothing
        flag.with_name("first.go").touch()
        assert first.wait(timeout=300) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert status(run)["state"] == "done"
    assert_same_results(ref, run)
    RESULTS["train --out alias --resume while runs/a trains"] = True
