"""Persistent local workers: a run trained by a process that trained another run first
equals the run trained alone in a fresh process, bit for bit; a worker that dies takes
down only the run it held."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
from sweep_helpers import attempts, metrics, tiny_grid

from qkgeom.experiments import run_one, run_sweep
from qkgeom.runs import read_status
from qkgeom.runs.sweep import WORKER_LOG, run_dir

LOG_COLS = ["step", "loss", "val_loss", "lr"]


def _same_run(a: Path, b: Path) -> None:
    pd.testing.assert_frame_equal(metrics(a).drop(columns="run_id"),
                                  metrics(b).drop(columns="run_id"), check_exact=True)
    pd.testing.assert_frame_equal(pd.read_parquet(a / "train_log.parquet")[LOG_COLS],
                                  pd.read_parquet(b / "train_log.parquet")[LOG_COLS],
                                  check_exact=True)


# Dropout on: the runs draw from torch's global generator, so a generator left behind by
# an earlier run in the process would show in the metrics.
DROPOUT = {"model": {"dropout": 0.1}}


@pytest.fixture(scope="module")
def fresh_seed0(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """seed=0 trained as the only run of a fresh worker process."""
    out = tmp_path_factory.mktemp("fresh")
    run_sweep(tiny_grid(sample_data, name="fresh", seeds=[0], **DROPOUT), out, workers=1,
              threads_per_run=1, progress=False, max_runs_per_worker=1)
    return run_dir(out, "seed=0")


def test_a_reused_worker_trains_a_run_exactly_as_a_fresh_process(
        fresh_seed0: Path, sample_data: Path, tmp_path: Path) -> None:
    """seed=1 then seed=0 in one worker process; seed=0 equals the fresh-process one."""
    out = tmp_path / "reused"
    summary = run_sweep(tiny_grid(sample_data, seeds=[1, 0], **DROPOUT), out, workers=1,
                        threads_per_run=1, progress=False)
    assert summary.counts["done"] == 2 and summary.trained == ["seed=1", "seed=0"]
    first, second = (attempts(run_dir(out, r))[0] for r in ("seed=1", "seed=0"))
    assert first["pid"] == second["pid"] != os.getpid()  # one process trained both
    assert attempts(fresh_seed0)[0]["pid"] != second["pid"]
    _same_run(fresh_seed0, run_dir(out, "seed=0"))
    log = (run_dir(out, "seed=0") / WORKER_LOG).read_text()
    assert "seed=1" not in log  # each run's output in its own worker.log


def test_run_one_resets_what_an_earlier_run_in_the_process_changed(
        fresh_seed0: Path, sample_data: Path, tmp_path: Path) -> None:
    """In this very process: a 2-thread run (another seed), a draw from torch's global
    generator, then the 1-thread seed=0 run; the latter equals the fresh-process one."""
    import torch

    before = torch.get_num_threads()
    specs = {s.run_id: s for s in tiny_grid(sample_data, seeds=[0, 2], **DROPOUT).expand()}
    try:
        other = run_one(str(tmp_path / "runs" / "seed=2"), specs["seed=2"].config.to_dict(), 2)
        assert other["state"] == "done" and torch.get_num_threads() == 2
        torch.rand(7)  # leave the global generator somewhere else
        result = run_one(str(tmp_path / "runs" / "seed=0"), specs["seed=0"].config.to_dict(), 1)
    finally:
        torch.set_num_threads(before)
    assert result["state"] == "done"
    _same_run(fresh_seed0, tmp_path / "runs" / "seed=0")


def test_a_fresh_process_per_run_is_still_available(sample_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "fresh"
    summary = run_sweep(tiny_grid(sample_data, seeds=[0, 1], steps=10), out, workers=1,
                        threads_per_run=1, progress=False, max_runs_per_worker=1)
    assert summary.counts["done"] == 2
    pids = {attempts(run_dir(out, r))[0]["pid"] for r in ("seed=0", "seed=1")}
    assert len(pids) == 2


@pytest.mark.slow
def test_a_worker_killed_mid_run_fails_that_run_only(sample_data: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The first checkpoint write of the sweep SIGKILLs its worker (once): that run is
    recorded failed with the cause, a new worker trains the other runs, and a rerun with
    retry_failed finishes it."""
    monkeypatch.setenv("QKGEOM_FAULT", "kill:ckpt_*.pt:1")
    monkeypatch.setenv("QKGEOM_FAULT_ONCE", str(tmp_path / "fired"))
    out = tmp_path / "sweep"
    grid = tiny_grid(sample_data, seeds=[0, 1, 2])
    summary = run_sweep(grid, out, workers=1, threads_per_run=1, progress=False)
    assert summary.states == {"seed=0": "failed", "seed=1": "done", "seed=2": "done"}
    status = read_status(run_dir(out, "seed=0"))
    assert "killed by signal 9" in status["error"] and "\n" not in status["error"]
    pids = [attempts(run_dir(out, r))[0]["pid"] for r in ("seed=0", "seed=1", "seed=2")]
    assert pids[0] != pids[1] == pids[2]  # a new worker took over, and stayed
    again = run_sweep(grid, out, workers=1, threads_per_run=1, progress=False,
                      retry_failed=True)
    assert again.trained == ["seed=0"] and again.complete


def test_fresh_run_state_drops_compiled_graphs_and_sets_threads() -> None:
    """A reused process must not keep the last run's compiled graphs (dynamo would pile up
    one per model until its recompile limit sends later runs to eager mode)."""
    import torch

    from qkgeom.experiments.worker import fresh_run_state

    compiled: list[int] = []

    def backend(gm, example_inputs):  # counts compilations, runs the graph as it is
        compiled.append(1)
        return gm.forward

    f = torch.compile(lambda x: torch.sin(x) * 2, backend=backend)
    x = torch.ones(3)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # dynamo guards on the thread count: keep it fixed here
    try:
        f(x)
        f(x)
        assert len(compiled) == 1  # cached
        fresh_run_state(1)
        assert torch.get_num_threads() == 1
        f(x)
        assert len(compiled) == 2  # compiled again: the cache was dropped
    finally:
        torch.set_num_threads(before)
        torch._dynamo.reset()
