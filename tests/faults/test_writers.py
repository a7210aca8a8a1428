"""Attack 6: two writers on one run. ``train --resume`` takes the run's lock before it
writes anything: a second resume of the same run, while the first is mid-run, stops with
one line naming the holder (pid and host) and touches nothing; the first finishes with the
results of an uninterrupted run. Synchronised by file flags (the ``pause`` fault holds the
first writer at its first status write), never by sleeping."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from fault_helpers import (
    assert_clean_error,
    assert_same_results,
    cli,
    fault_env,
    figure,
    status,
    train_args,
    train_in_process,
)

from qkgeom.runs import RunLock
from qkgeom.training.checkpoint import list_checkpoints

STEPS, EVERY = 16, 4
RESULTS: dict[str, bool] = {}


def _snapshot(run: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``run`` (and the lock beside it) with its size and mtime."""
    files = [p for p in run.rglob("*") if p.is_file()]
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in files}


def _wait_for(flag: Path, proc, timeout: float = 240) -> None:
    """Until ``flag`` exists (the process reached its pause point), or fail."""
    deadline = time.monotonic() + timeout
    while not flag.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the first writer never reached its pause point"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def interrupted(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 16-step run killed half-way through its step-8 checkpoint (newest: step 4)."""
    out = tmp_path_factory.mktemp("writers") / "run"
    res = cli(*train_args(sample_data, out, STEPS, EVERY), fault="kill:ckpt_*.pt:2")
    assert res.returncode == -9, res.stderr
    assert [s for s, _ in list_checkpoints(out)] == [4]
    return out


@pytest.mark.slow
def test_two_concurrent_resumes_one_trains_the_other_is_refused(
        sample_data: Path, interrupted: Path, tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    ref = train_in_process(sample_data, tmp_path / "ref", STEPS, EVERY)
    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    flag = tmp_path / "first"
    env = dict(fault_env("pause:status.json:1"), QKGEOM_FAULT_PAUSE=str(flag))
    args = [*train_args(sample_data, run, STEPS, EVERY), "--resume"]
    first = subprocess.Popen([sys.executable, "-m", "qkgeom.cli", *args], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(flag.with_name("first.waiting"), first)  # lock held, run under way
        before = _snapshot(run)
        second = cli(*args)
        assert_clean_error(second.returncode, second.stderr,
                           words=(str(run), "another process is writing this run",
                                  f"pid {first.pid} on host {socket.gethostname()}"))
        assert _snapshot(run) == before  # the refused writer touched nothing
        flag.with_name("first.go").touch()
        assert first.wait(timeout=300) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            first.kill()
    assert status(run)["state"] == "done"
    assert_same_results(ref, run)
    RESULTS["two concurrent resumes"] = True
    figure("two writers", "second resume refused in one line naming the holder's pid and "
           "host, nothing touched; first resume finished bit-exact")


def test_train_refuses_a_run_another_process_holds(sample_data: Path, interrupted: Path,
                                                    tmp_path: Path) -> None:
    """A sweep worker (here: this test process) holds the run; a plain train --resume of
    it is refused; once released, the same command trains."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    lock = RunLock(run)
    assert lock.acquire()
    try:
        before = _snapshot(run)
        res = cli(*train_args(sample_data, run, STEPS, EVERY), "--resume")
        assert_clean_error(res.returncode, res.stderr,
                           words=("another process is writing this run", f"pid {os.getpid()}"))
        assert _snapshot(run) == before
    finally:
        lock.release()
    res = cli(*train_args(sample_data, run, STEPS, EVERY), "--resume")
    assert res.returncode == 0, res.stderr
    RESULTS["train vs a held sweep lock"] = True


def test_a_fresh_train_into_a_held_folder_is_refused(sample_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "fresh"
    lock = RunLock(out)
    assert lock.acquire()
    try:
        res = cli(*train_args(sample_data, out, 4, 4))
        assert_clean_error(res.returncode, res.stderr, words=("another process",))
        assert not out.exists()
    finally:
        lock.release()
    RESULTS["fresh train into a held folder"] = True


def test_monitor_takes_the_same_lock(tmp_path: Path) -> None:
    import torch

    from qkgeom.config import GPTConfig
    from qkgeom.errors import QKGeomError
    from qkgeom.model import GPT
    from qkgeom.monitor import GeometryMonitor
    from qkgeom.monitor.monitor import MONITOR_LOCK

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=11))
    ids = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(0))
    first = GeometryMonitor(model, ids, out=tmp_path / "mon", tensorboard=None, wandb=False)
    first.start(0)
    lock_file = tmp_path / "mon" / MONITOR_LOCK  # inside the folder: nothing beside it
    assert lock_file.is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["mon"]
    holder = RunLock(tmp_path / "mon", lock_file)
    import subprocess
    import sys

    code = (f"from qkgeom.runs import RunLock; import sys; "
            f"sys.exit(0 if RunLock({str(tmp_path / 'mon')!r}, {str(lock_file)!r}).acquire() "
            "else 3)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 3  # held by the monitor
    first.close()
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0  # released at close
    second = GeometryMonitor(model, ids, out=tmp_path / "mon", resume=True, tensorboard=None,
                             wandb=False)
    with pytest.raises(QKGeomError, match="already holds a run"):
        GeometryMonitor(model, ids, out=tmp_path / "mon", tensorboard=None, wandb=False)
    second.start(1)
    assert not holder.acquire()  # exclusive, also within one process ...
    assert holder.acquire(reentrant=True)  # ... unless a holder joins its process's hold
    holder.release()
    second.close()
    assert holder.acquire()
    holder.release()
    RESULTS["monitor folder lock"] = True
    figure("one writer per run", f"{sum(RESULTS.values())}/{len(RESULTS)} cases handled "
           f"cleanly ({'; '.join(RESULTS)})")
