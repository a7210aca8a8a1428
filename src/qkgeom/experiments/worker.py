"""One run of a sweep: lock, skip or resume, train, record the outcome; and the worker loop.

:func:`run_one` is the only code that trains a sweep's run, in a persistent local worker
process (:func:`serve`, ``python -m qkgeom.experiments worker``) or a Ray task. A process
that trains runs in turn pays the torch import once; what one run could leave for the next
is reset before each (:func:`fresh_run_state`), so a run's metrics are the same bit for bit
in a fresh or a reused process (tests/experiments/test_worker_reuse.py). A run folder that
holds a symbolic link is refused (recorded ``failed``), and the files a worker appends to
are opened without following links. SIGTERM stops a worker as SIGINT does: the run records
``interrupted`` and stays resumable.
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
from collections.abc import Iterator
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

    Returns :func:`result_of`: the run's state afterwards (done | diverged | failed |
    locked) and what this call did (trained | resumed | skipped | locked | refused). An
    exception in training is recorded ``failed`` (traceback in error.log) and returned,
    never raised; KeyboardInterrupt is not caught, so an interrupted run stays resumable.
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
    """Mark a run ``failed`` whose worker died without recording anything, under the run's
    lock (a run another process has picked up meanwhile is left alone); returns whether
    the failure was written."""
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
    """Leave nothing of an earlier run in this process that could change the next one:
    torch's thread count (``threads``; 0 leaves it), torch.compile's in-memory caches (else
    dynamo's recompile limit would send later runs to eager mode) and the memory the last
    run held (returned on CUDA too, so a packed GPU sees it free). The trainer seeds every
    generator itself."""
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
def _output_to(log: Path) -> Iterator[None]:
    """File descriptors 1 and 2 into ``log`` for the block, then back. A log that cannot be
    opened safely (a planted link) is not used: :func:`run_one` then refuses the run."""
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
    ``config``, ``threads``, ``retry_failed``) in turn, each with its output in its
    worker.log, writing each result as one JSON line to ``results``; until the end of
    ``requests`` or ``max_runs`` runs. Returns the exit code (130/143 when interrupted)."""
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
    except KeyboardInterrupt as err:
        return getattr(err, "exit_code", 130)
    return 0


def warm_up() -> None:
    """Pay a process's one-time costs before the first run: importing torch and the
    trainer, and what torch imports for the first optimiser it builds."""
    import torch

    import qkgeom.launch  # noqa: F401

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def main(argv: list[str] | None = None) -> int:
    """Subprocess entry of the local backend: requests on stdin, results on stdout; every
    other line the process prints goes to stderr (or the run's worker.log)."""
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
