"""Persistent local worker processes: each trains the runs it is handed, one at a time.

Why not ``concurrent.futures.ProcessPoolExecutor``: a worker that dies hard (out-of-memory
kill, segfault) breaks an executor and every pending future, where here it fails one run;
each worker needs its own environment (threads, the GPU it is packed onto); and a worker
sends what a run prints to that run's worker.log. A worker is ``python -m
qkgeom.experiments worker`` (:func:`qkgeom.experiments.worker.serve`): one request per line
on its stdin, one result per line on its stdout, read by one thread per worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from qkgeom.errors import QKGeomError
from qkgeom.io import append_file, make_dir
from qkgeom.runs.sweep import WORKER_LOG

#: For the processes this package starts: else a user's ``random.py`` in the folder a
#: sweep starts from would shadow the standard library in every worker (Python >= 3.11).
SAFE_PATH = {"PYTHONSAFEPATH": "1"}
_TAIL = 4000  # bytes of a dead worker's own output copied into the run's worker.log
STOP_GRACE_S = 30.0  # seconds a stopped worker gets to record ``interrupted`` and exit


@dataclass(eq=False)
class Worker:
    """One worker process; ``key`` is the environment it was started with."""

    key: tuple[Any, ...]
    proc: subprocess.Popen[str]
    errors: IO[bytes]  # the worker's stderr outside runs
    run_dir: Path | None = None  # the run it trains now
    runs: int = 0  # runs handed to it so far
    retiring: bool = field(default=False)  # its stdin is closed: it ends after this run

    @property
    def busy(self) -> bool:
        return self.run_dir is not None


class WorkerPool:
    """Worker processes keyed by their environment; ``max_runs`` per worker (None: no
    limit; 1: a fresh process per run)."""

    def __init__(self, max_runs: int | None = None) -> None:
        self.max_runs = max_runs
        self.workers: list[Worker] = []
        self._events: queue.Queue[tuple[Worker, str | None]] = queue.Queue()

    def start(self, run_dir: Path, request: dict[str, Any], key: tuple[Any, ...],
              env: dict[str, str]) -> None:
        """Hand the run to an idle worker with this ``key``, or to a new one started with
        ``env`` (idle workers of other keys end first: never more processes than runs)."""
        worker = next((w for w in self.workers if not w.busy and not w.retiring
                       and w.key == key and w.proc.poll() is None), None)
        if worker is None:
            for idle in [w for w in self.workers if not w.busy]:
                self._retire(idle)
            worker = self._spawn(key, env)
        make_dir(run_dir)
        worker.run_dir = run_dir
        worker.runs += 1
        try:
            assert worker.proc.stdin is not None
            worker.proc.stdin.write(json.dumps({**request, "run_dir": str(run_dir)}) + "\n")
            worker.proc.stdin.flush()
        except OSError:  # it died while idle: its reader reports the end, the run fails
            pass
        if self.max_runs is not None and worker.runs >= self.max_runs:
            self._retire(worker)

    def _spawn(self, key: tuple[Any, ...], env: dict[str, str]) -> Worker:
        cmd = [sys.executable, "-m", "qkgeom.experiments", "worker"]
        if self.max_runs is not None:
            cmd += ["--max-runs", str(self.max_runs)]
        errors = tempfile.TemporaryFile()  # noqa: SIM115 - closed when the worker ends
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=errors, env={**os.environ, **SAFE_PATH, **env}, text=True,
                                bufsize=1)
        worker = Worker(key, proc, errors)
        self.workers.append(worker)
        threading.Thread(target=self._read, args=(worker,), daemon=True).start()
        return worker

    def _read(self, worker: Worker) -> None:
        assert worker.proc.stdout is not None
        for line in worker.proc.stdout:
            if line.strip():
                self._events.put((worker, line))
        self._events.put((worker, None))

    def _retire(self, worker: Worker) -> None:
        """Close its stdin: it ends once its current run (if any) is reported."""
        if not worker.retiring:
            worker.retiring = True
            with contextlib.suppress(OSError):
                assert worker.proc.stdin is not None
                worker.proc.stdin.close()

    def wait(self, timeout: float) -> list[tuple[Path, dict[str, Any] | None, str]]:
        """Runs that ended within ``timeout`` seconds: ``(run_dir, result, why)``; result
        None: the worker died holding the run (``why`` says how; the end of its own output
        is appended to the run's worker.log)."""
        ended: list[tuple[Path, dict[str, Any] | None, str]] = []
        try:
            event = self._events.get(timeout=max(timeout, 0))
            while True:  # then whatever else is ready, without waiting
                self._handle(*event, ended)
                event = self._events.get_nowait()
        except queue.Empty:
            return ended

    def _handle(self, worker: Worker, line: str | None,
                ended: list[tuple[Path, dict[str, Any] | None, str]]) -> None:
        run_dir = worker.run_dir
        if line is not None:
            try:
                result = json.loads(line)
            except json.JSONDecodeError:
                return  # not a result: nothing else is written to stdout
            worker.run_dir = None
            if run_dir is not None:
                ended.append((run_dir, result, ""))
            if result.get("state") == "failed" and result.get("action") != "skipped":
                self._retire(worker)  # whatever broke may have left the process unsound
            return
        code = worker.proc.wait()  # its stdout closed: the process is ending
        self.workers.remove(worker)
        if run_dir is not None:
            why = (f"killed by signal {-code}" + (" (out of memory?)" if code == -9 else "")
                   if code < 0 else f"exit code {code}")
            _append_tail(worker.errors, run_dir / WORKER_LOG)
            ended.append((run_dir, None, why))
        worker.errors.close()

    def cancel(self, signum: int = signal.SIGINT) -> None:
        """Stop every worker: ``signum`` passed on so each run records ``interrupted``,
        then those not ended after :data:`STOP_GRACE_S` are killed (at once on a second
        interrupt: never an orphan left training)."""
        for worker in self.workers:
            if worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signum)
        self._reap(STOP_GRACE_S)

    def close(self) -> None:
        """End the idle workers (their stdin closes), stop any still busy."""
        for worker in self.workers:
            self._retire(worker)
        if any(w.busy for w in self.workers):
            self.cancel()
        self._reap(10.0)

    def _reap(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for every worker to end, then kill the rest (also
        when interrupted while waiting)."""
        deadline = time.monotonic() + grace
        try:
            for worker in self.workers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        finally:
            for worker in self.workers:
                if worker.proc.poll() is None:
                    worker.proc.kill()
                    worker.proc.wait()
                with contextlib.suppress(OSError):
                    if worker.proc.stdin is not None:
                        worker.proc.stdin.close()
                worker.errors.close()
            self.workers.clear()


def _append_tail(source: IO[bytes], log: Path) -> None:
    """The last bytes of a dead worker's own output, appended to a run's worker.log."""
    with contextlib.suppress(OSError, ValueError):
        source.seek(0, os.SEEK_END)
        size = source.tell()
        source.seek(max(size - _TAIL, 0))
        tail = source.read()
        if tail:
            with contextlib.suppress(QKGeomError), append_file(log) as fh:  # never via a link
                fh.write(b"--- worker process output ---\n" + tail)
