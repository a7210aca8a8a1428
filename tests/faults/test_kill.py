"""Attack 1: SIGKILL at random moments (some in the middle of a checkpoint or Parquet
write), then resume: the results equal an uninterrupted run's bit for bit (CPU)."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import yaml
from fault_helpers import (
    assert_no_torn_files,
    assert_same_results,
    cli,
    figure,
    popen,
    status,
    train_args,
    train_in_process,
)

from qkgeom.training.checkpoint import list_checkpoints

# Event kills: SIGKILL half-way through the n-th write of a file (QKGEOM_FAULT in qkgeom.io):
# a checkpoint, a table part (metrics or log rows of one flush), the status; the whole
# metrics.parquet is written once per attempt (compaction at resume or at the end).
EVENTS = ("ckpt_*.pt", "p*-L0.parquet", "status.json", "metrics.parquet")


def _step_now(run: Path) -> int:
    try:
        return int(json.loads((run / "status.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1


def _kill_after_progress(proc, run: Path, rng: random.Random, timeout: float = 240) -> bool:
    """Time kill: once the run has moved past the step it started at, wait a random
    fraction of a second and SIGKILL it (and anything it started); False when the run
    finished first (on a quiet machine the last steps can take less than the wait)."""
    start = _step_now(run)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and _step_now(run) <= start:
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.4))
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        return True
    return False


@pytest.mark.slow
def test_train_resumes_bit_exact_after_ten_random_kills(sample_data: Path,
                                                       tmp_path: Path) -> None:
    steps = 100  # 25 checkpoints: room for 10 kills wherever they land
    ref = train_in_process(sample_data, tmp_path / "ref", steps)
    out = tmp_path / "run"
    args = [*train_args(sample_data, out, steps), "--resume"]
    rng = random.Random(7)
    plan = [f"kill:{e}:{rng.randint(1, 2) if e != 'metrics.parquet' else 1}"
            for e in (rng.choice(EVENTS) for _ in range(7))] + ["time"] * 3
    rng.shuffle(plan)
    tried = survived = 0
    moments = []
    for event in plan:
        left = (steps - max((s for s, _ in list_checkpoints(out)), default=0)) // 4
        if left == 0:
            break  # a kill landed after the last checkpoint: no training write is left
        if event.startswith(("kill:ckpt", "kill:p")) and int(event.rsplit(":", 1)[1]) > left:
            continue  # an attempt writes a checkpoint (and a table part) per 4 steps left
        if event == "time":
            proc = popen(*args)
            if not _kill_after_progress(proc, out, rng):
                assert proc.wait(timeout=240) == 0 and status(out)["state"] == "done"
                break  # the run ended before the kill's moment: nothing left to kill
        else:
            proc = popen(*args, fault=event)
        proc.wait(timeout=240)
        assert proc.returncode == -signal.SIGKILL, (event, proc.returncode, proc.stderr.read())
        tried += 1
        ckpts = [s for s, _ in list_checkpoints(out)]
        moments.append(f"{event}@{max(ckpts, default=0)}")
        assert_no_torn_files(out)
        # "done" only when the kill landed after the last write (the process was exiting).
        assert status(out)["state"] in ("running", "done")
        survived += 1
    res = cli(*args)
    assert res.returncode == 0, res.stderr
    assert status(out)["state"] == "done"
    assert_same_results(ref, out)
    assert not [p for p in out.rglob(".*.tmp")], "temp files of killed writes left behind"
    figure("kill train", f"kills survived {survived}/{tried}, final metrics bit-exact "
           f"(kill moments as event@newest-checkpoint: {', '.join(moments)})")


@pytest.mark.slow
def test_sweep_killed_three_times_trains_no_run_twice_and_loses_none(sample_data: Path,
                                                                     tmp_path: Path) -> None:
    """Each kill is an event: the workers run with a ``pause`` fault on the second
    checkpoint write of their attempt; once one of them is held there (mid-run, its
    checkpoint written to a temp file, not yet in place), the sweep and its workers are
    SIGKILLed together, a pre-emption. Each attempt moves a run on by at most one
    checkpoint, so every attempt has a run to kill."""
    steps, seeds = 16, [0, 1]
    base = {"data": str(sample_data), "steps": steps, "checkpoint_every": 4, "probe_every": 4,
            "eval_every": 4, "log_every": 4, "warmup_steps": 2}
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"name": "kills", "preset": "smoke", "base": base,
                                    "axes": {"seed": seeds}}))
    out = tmp_path / "sweep"
    args = ["sweep", "run", str(grid), "--out", str(out), "--workers", "2", "--threads", "1",
            "--quiet"]
    runs = [out / "runs" / f"seed={s}" for s in seeds]
    killed = 0
    for attempt in range(3):
        flag = tmp_path / f"pause{attempt}"
        proc = popen(*args, fault="pause:ckpt_*.pt:2", pause=flag)
        deadline = time.monotonic() + 240
        waiting = flag.with_name(flag.name + ".waiting")
        while not waiting.exists():
            assert proc.poll() is None, proc.stderr.read()  # the sweep must not end first
            assert time.monotonic() < deadline, "no worker reached its pause point"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its workers: a pre-emption
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL  # the kill landed on a running sweep
        assert any(status(r)["state"] != "done" for r in runs if (r / "status.json").exists())
        killed += 1
    res = cli(*args)
    assert res.returncode == 0, res.stderr
    again = cli(*args)  # everything finished: nothing may be trained again
    assert again.returncode == 0 and "done 2" in again.stdout, again.stdout
    twice = lost = 0
    for seed in seeds:
        run = out / "runs" / f"seed={seed}"
        assert status(run)["state"] == "done"
        ref = train_in_process(sample_data, tmp_path / f"ref{seed}", steps, seed=seed)
        assert_same_results(ref, run)
        lines = [json.loads(x) for x in (run / "attempts.jsonl").read_text().splitlines()]
        starts = [a["resume_from"] for a in lines]
        # A run restarts from scratch only while it has no checkpoint; afterwards each
        # attempt resumes from a checkpoint no older than the previous attempt's.
        seen = [s for s in starts if s is not None]
        twice += int(seen != sorted(seen) or bool(seen and starts[-1] is None))
        lost += int(not (run / "metrics.parquet").exists())
    assert twice == 0 and lost == 0
    figure("kill sweep", f"kills landed {killed}/3; runs trained twice {twice}, "
           f"runs lost {lost}, {len(seeds)}/{len(seeds)} runs bit-exact")
