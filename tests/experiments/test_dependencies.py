"""Arms that reference another arm's run: the sweep runner's order, failures and reruns.

A scripted backend stands in for the workers in the first tests (which run finishes when,
and how), so the scheduling rules are checked exactly; the last test is a real sweep of
tiny runs killed mid-way and run again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from sweep_helpers import attempts, sweep_cmd, write_grid

import qkgeom.experiments.runner as runner_mod
from qkgeom.experiments import Grid, run_sweep, sweep_status
from qkgeom.io import write_json
from qkgeom.runs import STATUS, lock_is_held, read_status
from qkgeom.runs.sweep import run_dir

NONE = {"name": "none", "set": {"key_control.mode": "none", "key_control.record": True}}
SHAM = {"name": "sham", "set": {"key_control.mode": "sham"}, "reference": "none"}
HOLD = {"name": "hold", "set": {"key_control.mode": "hold"}}


def arm_grid(data: Path, seeds: list[int], steps: int = 20, **base: Any) -> Grid:
    return Grid.from_dict({
        "name": "deps", "preset": "smoke",
        "base": {"data": str(data), "steps": steps, "probe_every": 10, "eval_every": 10,
                 "checkpoint_every": 10, **base},
        "axes": {"seed": seeds}, "arms": [NONE, SHAM, HOLD]})


class Scripted:
    """A backend whose runs finish one per ``wait``, oldest first, with scripted states; it
    writes their status.json as a worker would and checks each start's reference."""

    def __init__(self, outcomes: dict[str, str]) -> None:
        self.outcomes, self.started, self.running = outcomes, [], []
        self.busy: list[int] = []  # runs in flight at each wait

    def submit(self, folder: Path, config: dict[str, Any], threads: int,
               retry_failed: bool) -> None:
        ref = config["key_control"]["reference"]
        if ref:  # a dependent starts only once its reference is done
            assert (read_status(folder.parent / ref) or {}).get("state") == "done", folder.name
        self.started.append(folder.name)
        self.running.append(folder)

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        self.busy.append(len(self.running))
        folder = self.running.pop(0)
        state = self.outcomes.get(folder.name, "done")
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / STATUS, {"state": state, "step": 20, "steps": 20,
                                     "error": "boom" if state == "failed" else None})
        return [{"run_id": folder.name, "state": state, "step": 20, "steps": 20,
                 "error": None, "action": "trained"}]

    def cancel(self) -> None: ...

    def close(self) -> None: ...


def sweep(grid: Grid, out: Path, backend: Scripted, monkeypatch: pytest.MonkeyPatch,
          **kw: Any):
    monkeypatch.setattr(runner_mod, "make_backend", lambda name, address=None, retries=0, **kw: backend)
    return run_sweep(grid, out, threads_per_run=1, progress=False, **kw)


def test_dependents_wait_for_their_reference_and_others_go_first(
        sample_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = Scripted({})
    summary = sweep(arm_grid(sample_data, [0, 1]), tmp_path / "s", backend, monkeypatch,
                    workers=2)
    assert summary.counts["done"] == 6 and summary.complete
    # seed 0's sham waits for seed 0's none; hold (no reference) fills the second worker
    assert backend.started == ["seed=0,arm=none", "seed=0,arm=hold", "seed=0,arm=sham",
                               "seed=1,arm=none", "seed=1,arm=hold", "seed=1,arm=sham"]
    assert backend.busy == [2, 2, 2, 2, 2, 1]  # never idle while something could run
    record = sweep_status(tmp_path / "s")
    assert list(record.columns[:3]) == ["run_id", "seed", "arm"]
    assert record.set_index("run_id").loc["seed=1,arm=sham", "arm"] == "sham"


def test_a_reference_that_diverged_or_failed_fails_its_dependents(
        sample_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "s"
    grid = arm_grid(sample_data, [0, 1])
    backend = Scripted({"seed=0,arm=none": "diverged", "seed=1,arm=none": "failed"})
    summary = sweep(grid, out, backend, monkeypatch, workers=1)
    assert "seed=0,arm=sham" not in backend.started and "seed=1,arm=sham" not in backend.started
    assert summary.states == {
        "seed=0,arm=none": "diverged", "seed=0,arm=sham": "failed", "seed=0,arm=hold": "done",
        "seed=1,arm=none": "failed", "seed=1,arm=sham": "failed", "seed=1,arm=hold": "done"}
    for seed, why in ((0, "diverged"), (1, "failed")):
        status = read_status(run_dir(out, f"seed={seed},arm=sham"))
        assert status["state"] == "failed"
        assert status["error"] == f"reference run seed={seed},arm=none {why}"

    again = Scripted({})  # a rerun retries nothing that failed ...
    assert sweep(grid, out, again, monkeypatch, workers=1).states == summary.states
    assert again.started == []
    retry = Scripted({})  # ... unless asked: the failed reference, then its dependent
    states = sweep(grid, out, retry, monkeypatch, workers=1, retry_failed=True).states
    assert retry.started == ["seed=1,arm=none", "seed=1,arm=sham"]
    assert states["seed=1,arm=sham"] == "done" and states["seed=0,arm=sham"] == "failed"


def _until(condition, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Poll ``condition`` while the sweep process lives (it must not end first)."""
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        assert proc.poll() is None, f"sweep exited early: {proc.stderr.read()}"
        time.sleep(0.02)
    raise AssertionError("timed out waiting for the sweep")


@pytest.mark.slow
def test_a_killed_sweep_with_references_finishes_each_run_once(sample_data: Path,
                                                              tmp_path: Path) -> None:
    """Killed while the dependent trains (its reference done), run again: every run ends
    done, the reference and the other arm trained once, the dependent resumed once from
    its checkpoint, and the dependent's first start came after its reference was done."""
    grid = arm_grid(sample_data, [0], steps=40)
    grid_file = write_grid(tmp_path / "deps.yaml", grid)
    out = tmp_path / "sweep"
    ref, dep, hold = (run_dir(out, f"seed=0,arm={a}") for a in ("none", "sham", "hold"))
    proc = subprocess.Popen(sweep_cmd(grid_file, out), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _until(lambda: (dep / "checkpoints" / "ckpt_00000020.pt").exists(), proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while lock_is_held(dep) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert read_status(ref)["state"] == "done" and read_status(dep)["state"] == "running"
    assert read_status(hold) is None  # grid order: the dependent came before hold

    summary = run_sweep(grid, out, workers=1, threads_per_run=1, progress=False)
    assert summary.counts["done"] == 3 and summary.trained == ["seed=0,arm=sham",
                                                               "seed=0,arm=hold"]
    assert len(attempts(ref)) == 1 and len(attempts(hold)) == 1
    tries = attempts(dep)
    assert len(tries) == 2 and tries[0]["resume_from"] is None and tries[1]["resume_from"] >= 20
    assert tries[0]["started"] >= read_status(ref)["updated"] - 1e-3
    assert read_status(dep)["state"] == "done"
