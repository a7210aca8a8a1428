"""Attack group 6: signals. SIGTERM and SIGINT stop ``train`` with one line saying where
it stopped and how to resume (or that no checkpoint exists yet), exit 143 / 130, and
``status.json`` = ``interrupted`` with the step and the newest checkpoint; the resume ends
bit-exact. ``watch`` ends when nobody writes the run, ``report`` on an unfinished run
says so in one line, and the ``sweep run`` driver passes SIGTERM on to its workers and
waits for them (no orphan keeps training), after which a rerun resumes. Synchronised by
file flags (the ``pause`` fault holds a checkpoint write), never by sleeping."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fault_helpers import (
    assert_clean_error,
    assert_same_results,
    cli,
    error_lines,
    fault_env,
    group_figure,
    in_process,
    status,
    train_args,
    train_in_process,
)

from qkgeom.runs import lock_is_held
from qkgeom.training.checkpoint import list_checkpoints

STEPS, EVERY = 12, 4
RESULTS: dict[str, bool] = {}


_figure = group_figure("signals", RESULTS)


@pytest.fixture(scope="module")
def reference(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_in_process(sample_data, tmp_path_factory.mktemp("sig") / "ref", STEPS, EVERY)


def _default_signals() -> None:
    """In the child, before exec: SIGINT and SIGTERM at their defaults. A suite started in
    the background (``pytest &``, nohup) runs with SIGINT ignored, which a child inherits,
    and a process started with SIGINT ignored rightly keeps ignoring it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _start(args: list[str], flag: Path, fault: str) -> subprocess.Popen:
    """The CLI in its own session, held at the ``fault`` pause until ``flag.go``."""
    env = dict(fault_env(fault), QKGEOM_FAULT_PAUSE=str(flag))
    return subprocess.Popen([sys.executable, "-m", "qkgeom.cli", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_signals)


def _wait_paused(proc: subprocess.Popen, flag: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not flag.with_name(flag.name + ".waiting").exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the process never reached its pause"
        time.sleep(0.01)


def _stop_group(proc: subprocess.Popen) -> None:
    """Tear down whatever is left of the process's session (a failing test's orphans)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize(("sig", "nth"), [(signal.SIGTERM, 2), (signal.SIGINT, 1)])
def test_a_signalled_train_says_how_to_resume_and_resumes_bit_exact(
        sample_data: Path, reference: Path, tmp_path: Path, sig: signal.Signals,
        nth: int) -> None:
    run = tmp_path / "run"
    flag = tmp_path / "flag"
    args = train_args(sample_data, run, STEPS, EVERY)
    proc = _start(args, flag, f"pause:ckpt_*.pt:{nth}")  # held writing checkpoint nth
    try:
        _wait_paused(proc, flag)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        _stop_group(proc)
    name, step = sig.name, nth * EVERY
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert_clean_error(proc.returncode, err, expect=128 + sig,
                       words=(f"interrupted ({name}) at step {step}", str(run / "status.json")))
    st = status(run)
    ckpt = (nth - 1) * EVERY or None
    assert (st["state"], st["step"], st["signal"], st["checkpoint"]) == (
        "interrupted", step, name, ckpt)
    assert [s for s, _ in list_checkpoints(run)] == ([ckpt] if ckpt else [])
    if ckpt:
        assert f"step-{ckpt} checkpoint" in err and "--resume" in err
    else:
        assert "no checkpoint exists yet" in err and "from step 0" in err
    res = cli(*args, "--resume")
    assert res.returncode == 0, res.stderr
    if not ckpt:  # the restart is said, never silent
        assert "no checkpoint yet" in res.stderr and "starts over from step 0" in res.stderr
    assert status(run)["state"] == "done"
    assert_same_results(reference, run)
    RESULTS[f"{name} to train ({'after' if ckpt else 'before'} the first checkpoint)"] = True


def _unfinished(reference: Path, folder: Path) -> Path:
    """A copy of a run whose status says it is running at step 4 while nobody holds it
    (the process was killed)."""
    shutil.copytree(reference, folder)
    (folder / "status.json").write_text(json.dumps({"state": "running", "step": 4,
                                                    "steps": STEPS}))
    return folder


def test_watch_ends_when_nobody_writes_the_run(reference: Path, tmp_path: Path) -> None:
    run = _unfinished(reference, tmp_path / "run")
    # a subprocess with a deadline: before, watch waited for ever on such a run
    res = subprocess.run([sys.executable, "-m", "qkgeom.cli", "watch", str(run),
                          "--interval", "0.05"], capture_output=True, text=True, timeout=120)
    assert_clean_error(res.returncode, res.stderr, expect=1,
                       words=(str(run), "nobody is writing this run", "--resume"))
    RESULTS["watch on a run nobody writes"] = True


def test_report_on_an_unfinished_run_says_so(reference: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = _unfinished(reference, tmp_path / "run")
    code, out, err = in_process(["report", str(run)], capsys)
    assert_clean_error(code, err, words=(str(run), "not finished", "step 4/12"))
    assert not (run / "report").exists() and "nan" not in out
    RESULTS["report on an unfinished run"] = True


@pytest.mark.slow
def test_sigterm_to_the_sweep_driver_stops_its_workers_and_a_rerun_resumes(
        sample_data: Path, reference: Path, tmp_path: Path) -> None:
    base = {"data": str(sample_data), "steps": STEPS, "checkpoint_every": EVERY,
            "probe_every": EVERY, "eval_every": EVERY, "log_every": EVERY, "warmup_steps": 2}
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"name": "g", "preset": "smoke", "base": base}))
    out = tmp_path / "sweep"
    run = out / "runs" / "base"
    args = ["sweep", "run", str(grid), "--out", str(out), "--threads", "1", "--quiet"]
    flag = tmp_path / "flag"
    driver = _start(args, flag, "pause:ckpt_*.pt:2")  # the worker holds at its step-8 ckpt
    try:
        _wait_paused(driver, flag)
        driver.send_signal(signal.SIGTERM)  # the driver only, as a scheduler would
        _, err = driver.communicate(timeout=120)
        # the driver ended after its worker: nobody holds the run, nothing trains on
        assert not lock_is_held(run)
    finally:
        _stop_group(driver)
    assert driver.returncode == 143, err
    assert_clean_error(driver.returncode, err, expect=143,
                       words=("interrupted (SIGTERM)", "run the same command again"))
    st = status(run)
    assert (st["state"], st["step"], st["checkpoint"]) == ("interrupted", 8, 4)
    res = cli(*args)
    assert res.returncode == 0, res.stderr
    assert "locked" not in res.stdout and not error_lines(res.stderr)
    attempts = [json.loads(x) for x in (run / "attempts.jsonl").read_text().splitlines()]
    assert [a["resume_from"] for a in attempts] == [None, 4]  # the rerun resumed
    assert status(run)["state"] == "done"
    assert_same_results(reference, run)
    RESULTS["SIGTERM to the sweep driver"] = True
