"""One run of a sweep, in its own process: lock, skip or resume, train, record the outcome.

:func:`run_one` is the only code that trains a sweep's run, whatever the backend: the local
backend calls it in a fresh ``python -m qkgeom.experiments worker`` subprocess, the Ray
backend as a Ray task (a fresh worker process per task). A process per run means
``torch.set_num_threads`` and allocator state never leak from one run into the next, and a
hard crash (segfault, out-of-memory kill) takes down one run, not the sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from qkgeom.errors import DivergedError, QKGeomError
from qkgeom.io import write_json
from qkgeom.runs import STATUS, RunLock, list_checkpoints, read_status
from qkgeom.runs.sweep import ATTEMPTS_FILE, ERROR_LOG

_MAX_MESSAGE = 300


def run_one(run_dir: str, config_dict: dict[str, Any], threads: int, *,
            retry_failed: bool = False) -> dict[str, Any]:
    """Train the run in ``run_dir`` unless it is finished or another process holds it.

    Returns ``{"run_id", "state", "step", "steps", "error", "action"}``: ``state`` is the
    run's state afterwards (done | diverged | failed, or ``locked`` when another process
    holds the run), ``action`` what this call did (trained | resumed | skipped | locked).
    A run whose status says ``done`` or ``diverged`` is skipped (a divergence is a result,
    not retried); ``failed`` is skipped unless ``retry_failed``; anything else (no status,
    or ``running`` without a lock holder, i.e. interrupted) is trained with ``resume=True``,
    which continues from the newest checkpoint or starts fresh when there is none. Any
    exception in training is recorded as ``failed`` with a one-line message in status.json
    (traceback in error.log) and returned, never raised; KeyboardInterrupt is not caught,
    so an interrupted run stays resumable.
    """
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run)
    if not lock.acquire():
        return _result(run, "locked", "locked", read_status(run))
    try:
        status = read_status(run)
        state = status.get("state") if status else None
        if state in ("done", "diverged") or (state == "failed" and not retry_failed):
            return _result(run, state, "skipped", status)
        return _train(run, dict(config_dict, threads=threads), status)
    finally:
        lock.release()


def _train(run: Path, config_dict: dict[str, Any],
           status: dict[str, Any] | None) -> dict[str, Any]:
    from qkgeom.config import from_dict
    from qkgeom.launch import train

    checkpoints = list_checkpoints(run)
    resume_from = checkpoints[-1][0] if checkpoints else None
    action = "resumed" if resume_from is not None else "trained"
    _append_attempt(run, resume_from, config_dict.get("threads", 0))
    (run / ERROR_LOG).unlink(missing_ok=True)  # it describes the latest failure only
    steps = int(config_dict.get("steps", 0))
    try:
        cfg = from_dict(config_dict)
        result = train(cfg, run, resume=True, progress=False, run_id=run.name)
    except DivergedError:
        return _result(run, "diverged", action, read_status(run))
    except Exception as err:  # recorded; the sweep goes on
        message = one_line(err)
        (run / ERROR_LOG).write_text(traceback.format_exc(), encoding="utf-8")
        last = read_status(run) or status or {}
        failed = {"state": "failed", "step": int(last.get("step", 0)), "steps": steps,
                  "error": message, "updated": time.time()}
        write_json(run / STATUS, failed)
        return _result(run, "failed", action, failed)
    return {"run_id": run.name, "state": "done", "step": result.step, "steps": steps,
            "error": None, "action": action}


def one_line(err: BaseException) -> str:
    """``Type: message`` on one line, at most a few hundred characters (user errors bare)."""
    text = str(err) if isinstance(err, QKGeomError) else f"{type(err).__name__}: {err}"
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE - 3] + "..."


def record_failure(run: Path, message: str) -> bool:
    """Mark a run ``failed`` after its worker died without recording anything itself.

    Takes the run's lock first, so a run that another process has meanwhile picked up is
    left alone; returns whether the failure was written.
    """
    lock = RunLock(run)
    if not lock.acquire():
        return False
    try:
        status = read_status(run) or {}
        if status.get("state") in ("done", "diverged", "failed"):
            return False
        write_json(run / STATUS, {
            "state": "failed", "step": int(status.get("step", 0)),
            "steps": int(status.get("steps", 0)), "error": message, "updated": time.time()})
        return True
    finally:
        lock.release()


def _append_attempt(run: Path, resume_from: int | None, threads: int) -> None:
    """One JSON line per training attempt: provenance of every (re)start of the run."""
    line = json.dumps({"started": time.time(), "host": socket.gethostname(),
                       "pid": os.getpid(), "resume_from": resume_from, "threads": threads})
    with open(run / ATTEMPTS_FILE, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


def _result(run: Path, state: str, action: str,
            status: dict[str, Any] | None) -> dict[str, Any]:
    status = status or {}
    return {"run_id": run.name, "state": state, "step": int(status.get("step", 0)),
            "steps": int(status.get("steps", 0)), "error": status.get("error"),
            "action": action}


def main(argv: list[str] | None = None) -> int:
    """Subprocess entry of the local backend: the result is the only thing on stdout.

    Everything else the run prints goes to stderr (the parent sends it to worker.log), so
    stdout carries exactly one JSON line the parent can parse.
    """
    parser = argparse.ArgumentParser(prog="python -m qkgeom.experiments worker")
    parser.add_argument("run_dir")
    parser.add_argument("--config", required=True, help="the run's config as JSON")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--retry-failed", action="store_true")
    args = parser.parse_args(argv)
    result_fd = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    try:
        result = run_one(args.run_dir, json.loads(args.config), args.threads,
                         retry_failed=args.retry_failed)
    except KeyboardInterrupt:
        return 130
    with os.fdopen(result_fd, "w", encoding="utf-8") as out:
        out.write(json.dumps(result) + "\n")
    return 0

