"""One run of a sweep: lock, skip or resume, train, record the outcome; and the worker loop.

:func:`run_one` is the only code that trains a sweep's run, whatever the backend: the local
backend calls it in a persistent ``python -m qkgeom.experiments worker`` subprocess that
trains the runs it is handed one after another (:func:`serve`), the Ray backend in a Ray
task. A process that trains several runs in turn pays the torch import and the first-step
warm-up once, not once per run; what one run could leave behind for the next is reset
before each run (:func:`fresh_run_state`: torch's thread count, torch.compile's caches,
freed memory; the trainer seeds every generator it uses), so a run gives the same metrics
bit for bit in a fresh process or in one that trained other runs before
(tests/experiments/test_worker_reuse.py). A hard crash (segfault, out-of-memory kill) takes
down the worker and the one run it held, which is recorded ``failed``; the sweep starts a
new worker for the next run.

The run folder may come from someone else (a sweep folder shared or downloaded): the run
is refused (recorded ``failed`` with the one-line reason) when its folder holds a symbolic
link (:func:`qkgeom.runs.refuse_links`), and the files a worker appends to
(``attempts.jsonl``, ``worker.log``) are opened without following links
(:func:`qkgeom.io.append_file`). SIGTERM stops a worker as SIGINT does: the run it trains
records ``interrupted`` and stays resumable.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from qkgeom.errors import DivergedError, QKGeomError, signals_interrupt
from qkgeom.io import append_file, make_dir, refuse_link, write_bytes
from qkgeom.runs import (
    RunLock,
    finished_state,
    list_checkpoints,
    one_line,
    read_status,
    record_failed,
    refuse_links,
)
from qkgeom.runs.sweep import ATTEMPTS_FILE, ERROR_LOG, WORKER_LOG


def run_one(run_dir: str, config_dict: dict[str, Any], threads: int, *,
            retry_failed: bool = False) -> dict[str, Any]:
    """Train the run in ``run_dir`` unless it is finished or another process holds it.

    Returns ``{"run_id", "state", "step", "steps", "error", "action"}``: ``state`` is the
    run's state afterwards (done | diverged | failed, or ``locked`` when another process
    holds the run), ``action`` what this call did (trained | resumed | skipped | locked).
    A finished run is skipped (:func:`qkgeom.runs.finished_state`); anything else is
    trained with ``resume=True``, which continues from the newest checkpoint or starts
    fresh when there is none. Any exception in training is recorded as ``failed`` with a
    one-line message in status.json (traceback in error.log) and returned, never raised;
    KeyboardInterrupt is not caught, so an interrupted run stays resumable.
    """
    run = Path(run_dir)
    try:
        make_dir(run)
        lock = RunLock(run)
        if not lock.acquire():
            return result_of(run, "locked", "locked", read_status(run))
    except QKGeomError as err:  # a link where the run folder or its lock should be
        return result_of(run, "failed", "refused", {"error": one_line(err)})
    try:
        try:
            refuse_links(run)
        except QKGeomError as err:  # recorded where status.json is not the link; not read
            message = one_line(err)
            return result_of(run, "failed", "refused",
                             record_failed(run, message, 0, keep=False) or {"error": message})
        status = read_status(run)
        state = finished_state(status, retry_failed)
        if state is not None:
            return result_of(run, state, "skipped", status)
        try:
            return _train(run, dict(config_dict, threads=threads))
        finally:
            fresh_run_state(0)  # hand back what the run held (a packed GPU's memory) now
    finally:
        lock.release()


def _train(run: Path, config_dict: dict[str, Any]) -> dict[str, Any]:
    from qkgeom.config import from_dict
    from qkgeom.launch import train

    checkpoints = list_checkpoints(run)
    resume_from = checkpoints[-1][0] if checkpoints else None
    action = "resumed" if resume_from is not None else "trained"
    steps = int(config_dict.get("steps", 0))
    try:
        _append_attempt(run, resume_from, config_dict.get("threads", 0))
        (run / ERROR_LOG).unlink(missing_ok=True)  # it describes the latest failure only
        cfg = from_dict(config_dict)
        fresh_run_state(int(config_dict.get("threads") or 0))
        result = train(cfg, run, resume=True, progress=False, run_id=run.name)
    except DivergedError:
        return result_of(run, "diverged", action, read_status(run))
    except Exception as err:  # recorded (the traceback in error.log); the sweep goes on
        with contextlib.suppress(QKGeomError):
            write_bytes(run / ERROR_LOG, traceback.format_exc().encode("utf-8"))
        message = one_line(err)
        return result_of(run, "failed", action,
                         record_failed(run, message, steps) or {"error": message})
    return result_of(run, "done", action, {"step": result.step, "steps": steps})


def record_failure(run: Path, message: str) -> bool:
    """Mark a run ``failed`` after its worker died without recording anything itself.

    Takes the run's lock first, so a run that another process has meanwhile picked up is
    left alone; returns whether the failure was written.
    """
    try:
        refuse_link(run)
        lock = RunLock(run)
        if not lock.acquire():
            return False
    except (QKGeomError, OSError):  # a link where the folder or its lock should be
        return False
    try:
        return finished_state(read_status(run)) is None and record_failed(run, message) is not None
    finally:
        lock.release()


def _append_attempt(run: Path, resume_from: int | None, threads: int) -> None:
    """One JSON line per training attempt: provenance of every (re)start of the run."""
    line = json.dumps({"started": time.time(), "host": socket.gethostname(),
                       "pid": os.getpid(), "resume_from": resume_from, "threads": threads})
    with append_file(run / ATTEMPTS_FILE) as fh:
        fh.write(line.encode("utf-8") + b"\n")


def result_of(run: Path, state: str, action: str,
              status: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a sweep learns of a run: its state afterwards and what this call did, with the
    step, planned steps and error of ``status``."""
    status = status or {}
    return {"run_id": run.name, "state": state, "step": int(status.get("step", 0)),
            "steps": int(status.get("steps", 0)), "error": status.get("error"),
            "action": action}


def fresh_run_state(threads: int) -> None:
    """Leave nothing of an earlier run in this process that could change the next one.

    The trainer seeds every generator it draws from, so what is left is process state:
    torch's intra-op thread count (``threads``; 0 leaves it), torch.compile's in-memory
    caches (a reused process would otherwise accumulate one compiled graph per model
    until dynamo's recompile limit sends later runs to eager mode; the on-disk inductor
    cache still makes the recompile quick), and the memory the last run's model and
    optimiser held (returned, on CUDA too, so a packed GPU sees it free).
    """
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _output_to(log: Path):
    """File descriptors 1 and 2 (print, warnings, C-level messages) into ``log`` for the
    block, then back where they were. A log that cannot be opened safely (a link planted
    in the run folder) is not used: the output stays where it was, and :func:`run_one`
    refuses the run."""
    try:
        make_dir(log.parent)
        fh = append_file(log)
    except QKGeomError:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    with fh:
        os.dup2(fh.fileno(), 1)
        os.dup2(fh.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved, 1)
            os.dup2(saved, 2)
            os.close(saved)


def serve(requests: Any, results: Any, max_runs: int | None = None) -> int:
    """Train the runs requested on ``requests`` (one JSON object per line: ``run_dir``,
    ``config``, ``threads``, ``retry_failed``) one after another, each with its output in
    its own worker.log, writing each :func:`run_one` result as one JSON line to
    ``results``. Ends at the end of ``requests`` or after ``max_runs`` runs; returns the
    exit code (130 when interrupted: the run it held stays resumable)."""
    done = 0
    try:
        for line in requests:
            if not line.strip():
                continue
            req = json.loads(line)
            with _output_to(Path(req["run_dir"]) / WORKER_LOG):
                result = run_one(req["run_dir"], req["config"], int(req["threads"]),
                                 retry_failed=bool(req.get("retry_failed")))
            results.write(json.dumps(result) + "\n")
            results.flush()
            done += 1
            if max_runs is not None and done >= max_runs:
                break
    except KeyboardInterrupt as err:  # 130 (SIGINT) or 143 (SIGTERM)
        return getattr(err, "exit_code", 130)
    return 0


def warm_up() -> None:
    """Pay a process's one-time costs before the first run: importing torch and the
    trainer, and what torch imports on the first optimiser it builds (torch._dynamo,
    sympy; measured in docs/speed.md)."""
    import torch

    import qkgeom.launch  # noqa: F401

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def main(argv: list[str] | None = None) -> int:
    """Subprocess entry of the local backend: requests on stdin, results on stdout.

    Everything else the process prints goes to stderr (and, during a run, to that run's
    worker.log), so stdout carries exactly the result lines the parent parses. The
    process warms up (:func:`warm_up`) before it reads the first request.
    """
    parser = argparse.ArgumentParser(prog="python -m qkgeom.experiments worker")
    parser.add_argument("--max-runs", type=int, default=None,
                        help="exit after this many runs (1: a fresh process per run)")
    args = parser.parse_args(argv)
    result_fd = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    with signals_interrupt():  # SIGTERM as SIGINT: the run in hand records interrupted
        try:
            warm_up()
        except KeyboardInterrupt as err:
            return getattr(err, "exit_code", 130)
        with os.fdopen(result_fd, "w", encoding="utf-8") as results:
            return serve(sys.stdin, results, args.max_runs)
