"""The local sweep runner on real tiny runs: train, skip, record failures and divergence."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from sweep_helpers import attempts, metrics, mtimes, run_cli, tiny_grid, write_grid

from qkgeom.errors import QKGeomError
from qkgeom.experiments import Grid, load_grid, run_one, run_sweep, sweep_status
from qkgeom.experiments.runner import available_cpus
from qkgeom.experiments.worker import record_failure
from qkgeom.runs import RunLock, lock_is_held
from qkgeom.runs.sweep import run_dir


def test_tiny_sweep_trains_every_run(local_tiny_sweep, sample_data: Path) -> None:
    out, summary = local_tiny_sweep
    assert summary.counts == {"done": 2, "diverged": 0, "failed": 0, "locked": 0, "pending": 0}
    assert sorted(summary.trained) == ["seed=0", "seed=1"] and summary.complete
    record = json.loads((out / "sweep.json").read_text())
    specs = tiny_grid(sample_data).expand()
    assert record["grid"] == json.loads(json.dumps(tiny_grid(sample_data).to_dict()))
    assert [(r["run_id"], r["axes"]) for r in record["runs"]] == \
        [(s.run_id, s.axes) for s in specs]
    assert "created" in record
    for spec, recorded in zip(specs, record["runs"], strict=True):
        run = run_dir(out, spec.run_id)
        status = json.loads((run / "status.json").read_text())
        assert status["state"] == "done" and status["step"] == 20
        saved = json.loads((run / "config.json").read_text())
        # The sweep records the hash the trainer writes (vocab_size filled in from the data).
        assert saved["config_hash"] == recorded["config_hash"]
        assert saved["config"]["threads"] == 1
        assert [a["threads"] for a in attempts(run)] == [1]
        assert set(metrics(run)["step"]) == {0, 10, 20}
    # Different seeds really are different runs.
    a, b = (metrics(run_dir(out, r)) for r in ("seed=0", "seed=1"))
    assert not a["value"].equals(b["value"])
    table = sweep_status(out)
    assert list(table.columns) == ["run_id", "seed", "state", "step", "steps", "error",
                                   "config_hash"]
    assert table["state"].tolist() == ["done", "done"] and table["seed"].tolist() == [0, 1]


def test_rerun_skips_finished_runs(local_tiny_sweep, sample_data: Path) -> None:
    out, _ = local_tiny_sweep
    before = mtimes(out / "runs")
    summary = run_sweep(tiny_grid(sample_data), out, workers=2, threads_per_run=1,
                        progress=False)
    assert summary.counts["done"] == 2 and summary.trained == []
    assert mtimes(out / "runs") == before  # nothing retrained, rewritten or logged


def test_a_different_grid_on_the_same_folder_is_refused(local_tiny_sweep,
                                                        sample_data: Path) -> None:
    out, _ = local_tiny_sweep
    before = mtimes(out)
    with pytest.raises(QKGeomError, match="different grid"):
        run_sweep(tiny_grid(sample_data, steps=30), out, progress=False)
    with pytest.raises(QKGeomError, match="different grid"):
        run_sweep(tiny_grid(sample_data, seeds=[0, 1, 2]), out, progress=False)
    assert mtimes(out) == before


def test_bad_arguments_fail_before_any_work(sample_data: Path, tmp_path: Path) -> None:
    grid = tiny_grid(sample_data)
    for kwargs, words in [({"workers": 0}, "workers"), ({"threads_per_run": 0}, "threads"),
                          ({"backend": "slurm"}, "unknown backend"),
                          ({"address": "auto"}, "--address is for the ray backend")]:
        with pytest.raises(QKGeomError, match=words):
            run_sweep(grid, tmp_path / "s", progress=False, **kwargs)
    assert not (tmp_path / "s" / "runs").exists()
    missing = tiny_grid(tmp_path / "no-such-data")
    with pytest.raises(QKGeomError, match="no-such-data"):
        run_sweep(missing, tmp_path / "s", progress=False)
    long_block = tiny_grid(sample_data, model={"block_size": 10**8})
    with pytest.raises(QKGeomError, match="too short"):
        run_sweep(long_block, tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()


def test_ray_backend_without_ray_is_a_clear_error(sample_data: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(QKGeomError, match=r"pip install 'qkgeom\[ray\]'"):
        run_sweep(tiny_grid(sample_data), tmp_path / "s", backend="ray", progress=False)
    assert not (tmp_path / "s").exists()


def test_failures_and_divergence_are_recorded_and_the_sweep_goes_on(
        sample_data: Path, tmp_path: Path) -> None:
    # A device that exists in no machine fails at train time, after validation.
    grid = Grid.from_dict({
        "name": "mixed", "preset": "smoke",
        "base": {"data": str(sample_data), "steps": 20, "probe_every": 10, "grad_clip": 0.0,
                 "warmup_steps": 0},
        "axes": {"device": ["cpu", "cuda:99"], "lr": [0.003, 1.0e6]},
    })
    ids = [s.run_id for s in grid.expand()]
    ok, diverging, failing, failing_too = ids
    out = tmp_path / "sweep"
    summary = run_sweep(grid, out, workers=2, threads_per_run=1, progress=True)
    assert summary.states == {ok: "done", diverging: "diverged", failing: "failed",
                              failing_too: "failed"}
    assert not summary.complete
    status = json.loads((run_dir(out, failing) / "status.json").read_text())
    assert status["state"] == "failed" and "cuda" in status["error"]
    assert "\n" not in status["error"]
    assert "Traceback" in (run_dir(out, failing) / "error.log").read_text()
    div = json.loads((run_dir(out, diverging) / "status.json").read_text())
    assert div["state"] == "diverged" and div["diverged_step"] >= 1
    table = sweep_status(out).set_index("run_id")
    assert table.loc[failing, "error"] == status["error"]
    assert table["state"].to_dict() == summary.states

    # A rerun retries nothing; retry_failed retries only the failed runs.
    again = run_sweep(grid, out, workers=2, threads_per_run=1, progress=False)
    assert again.trained == [] and again.states == summary.states
    retried = run_sweep(grid, out, workers=2, threads_per_run=1, progress=False,
                        retry_failed=True)
    assert sorted(retried.trained) == sorted([failing, failing_too])
    assert retried.states == summary.states
    assert [len(attempts(run_dir(out, r))) for r in ids] == [1, 1, 2, 2]


def test_run_one_respects_the_lock_and_finished_states(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    holder = RunLock(run)
    assert holder.acquire()
    try:
        assert lock_is_held(run)
        result = run_one(str(run), {"data": "/nonexistent"}, 1)
        assert result["state"] == "locked" and result["action"] == "locked"
        assert not (run / "status.json").exists()  # nothing was trained or recorded
        assert not record_failure(run, "boom")
    finally:
        holder.release()
    assert not lock_is_held(run)
    (run / "status.json").write_text(json.dumps({"state": "running", "step": 5, "steps": 9}))
    assert record_failure(run, "worker died")
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 5 and status["error"] == "worker died"
    assert status["steps"] == 9 and "wall_s" in status  # written by RunWriter, as the trainer's
    assert run_one(str(run), {}, 1)["action"] == "skipped"  # failed: not retried by default
    for state in ("done", "diverged"):
        (run / "status.json").write_text(json.dumps({"state": state, "step": 9, "steps": 9}))
        result = run_one(str(run), {}, 1, retry_failed=True)
        assert (result["state"], result["action"]) == (state, "skipped")


@pytest.mark.parametrize("cpus, workers, threads", [(5, 2, 2), (3, 4, 1)])
def test_default_threads_split_the_cpus(sample_data: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, cpus: int,
                                        workers: int, threads: int) -> None:
    """Without --threads each run gets the CPUs this process may use divided by the workers
    (rounded down, at least 1): read back from what the run recorded."""
    import qkgeom.experiments.runner as runner

    assert available_cpus() >= 1
    monkeypatch.setattr(runner, "available_cpus", lambda: cpus)
    grid = tiny_grid(sample_data, steps=2, seeds=[0], probe_every=2, checkpoint_every=2,
                     eval_every=2, warmup_steps=1)
    run_sweep(grid, tmp_path / "s", workers=workers, progress=False)
    run = run_dir(tmp_path / "s", "seed=0")
    assert json.loads((run / "config.json").read_text())["config"]["threads"] == threads
    assert [a["threads"] for a in attempts(run)] == [threads]
    assert json.loads((run / "status.json").read_text())["threads"] == threads


def test_cli_entry_status_and_bad_grid(local_tiny_sweep, tmp_path: Path) -> None:
    out, _ = local_tiny_sweep
    res = run_cli("status", str(out))
    assert res.returncode == 0, res.stderr
    assert "seed=0" in res.stdout and "done" in res.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("preset: smoke\naxes: {model.depth: [2]}\n")
    res = run_cli("run", str(bad), "--out", str(tmp_path / "s"), "--quiet")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "model.depth" in res.stderr
    assert not (tmp_path / "s").exists()


def test_grid_file_round_trip(sample_data: Path, tmp_path: Path) -> None:
    grid = tiny_grid(sample_data)
    again = load_grid(write_grid(tmp_path / "tiny.yaml", grid))
    assert again.to_dict() == grid.to_dict()
    assert [s.config_hash for s in again.expand()] == [s.config_hash for s in grid.expand()]
