"""Where a sweep's runs execute: local subprocesses or Ray tasks, both calling ``run_one``.

A backend only starts runs and reports finished ones; skipping, locking and recording are
:func:`~qkgeom.experiments.worker.run_one`'s job, identical for both.

**Local** starts one ``python -m qkgeom.experiments worker`` subprocess per run rather than
a ``ProcessPoolExecutor``: a worker that dies hard (out-of-memory kill, segfault) breaks a
process pool and fails every pending future with it, whereas a dead subprocess is one failed
run; ``max_tasks_per_child`` (a fresh process per run) needs Python 3.11; and the worker's
stderr goes straight to the run's worker.log. The cost is the interpreter start (about 3 s
of importing torch) per run, small next to training.

**Ray** submits ``run_one`` as one task per run with ``num_cpus=threads`` (plus
``num_gpus=1`` for a CUDA config), ``max_calls=1`` (a fresh worker process per run, as
locally) and ``max_retries=retries`` (default 0: a crashed run is recorded ``failed`` and
rerunning the sweep resumes it from its checkpoint; with ``--retries N`` Ray itself starts
a task whose worker died again, up to N times, and the retry resumes from the run's newest
checkpoint under the run's lock). Results go to the sweep folder, so that folder must be on
a filesystem every node sees, and qkgeom must be installed on every node. A local Ray
instance that qkgeom starts itself (no ``--address``) listens on 127.0.0.1 only (its node
address is the loopback one, no dashboard): nothing of it is reachable from the network.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Protocol

from qkgeom.errors import QKGeomError
from qkgeom.experiments.worker import record_failure
from qkgeom.runs.sweep import WORKER_LOG

BACKENDS = ("local", "ray")


class Backend(Protocol):
    def submit(self, run_dir: Path, config_dict: dict[str, Any], threads: int,
               retry_failed: bool) -> None: ...

    def wait(self, timeout: float) -> list[dict[str, Any]]: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...


def make_backend(name: str, address: str | None = None, retries: int = 0) -> Backend:
    """The backend called ``name``; Ray is imported (and connected) only when asked for."""
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise QKGeomError(f"--retries must be a whole number >= 0, got {retries!r}")
    if name == "local":
        if address is not None:
            raise QKGeomError("--address is for the ray backend; the local backend has none")
        if retries:
            raise QKGeomError("--retries is for the ray backend; locally, run the sweep again "
                              "(it resumes interrupted runs)")
        return LocalBackend()
    if name == "ray":
        return RayBackend(address, retries)
    raise QKGeomError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


def crashed(run_dir: Path, message: str) -> dict[str, Any]:
    """Record (under the run's lock) and report a worker that died without a result."""
    record_failure(run_dir, message)
    return {"run_id": run_dir.name, "state": "failed", "step": 0, "steps": 0,
            "error": message, "action": "crashed"}


class LocalBackend:
    """One subprocess per run on this machine; ``wait`` polls them."""

    def __init__(self) -> None:
        self._procs: dict[str, tuple[subprocess.Popen[str], Path, IO[bytes]]] = {}

    def submit(self, run_dir: Path, config_dict: dict[str, Any], threads: int,
               retry_failed: bool) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        log = open(run_dir / WORKER_LOG, "ab")  # noqa: SIM115 - closed when the run ends
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        cmd = [sys.executable, "-m", "qkgeom.experiments", "worker", str(run_dir),
               "--config", json.dumps(config_dict), "--threads", str(threads)]
        if retry_failed:
            cmd.append("--retry-failed")
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=log, env=env, text=True)
        self._procs[run_dir.name] = (proc, run_dir, log)

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        """Results of the runs that finished within ``timeout`` seconds (maybe none)."""
        deadline = time.monotonic() + timeout
        while True:
            done = [k for k, (p, _, _) in self._procs.items() if p.poll() is not None]
            if done or time.monotonic() >= deadline:
                break
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
        return [self._finish(run_id) for run_id in done]

    def _finish(self, run_id: str) -> dict[str, Any]:
        proc, run_dir, log = self._procs.pop(run_id)
        out = proc.stdout.read() if proc.stdout else ""
        proc.wait()
        log.close()
        if proc.stdout:
            proc.stdout.close()
        if proc.returncode == 0:
            with contextlib.suppress(json.JSONDecodeError, IndexError):
                return json.loads(out.strip().splitlines()[-1])
        code = proc.returncode
        why = (f"killed by signal {-code}" + (" (out of memory?)" if code == -9 else "")
               if code < 0 else f"exit code {code}")
        return crashed(run_dir, f"worker process died ({why}) without recording a result; "
                                f"see {run_dir / WORKER_LOG}")

    def cancel(self) -> None:
        """Stop every running worker (Ctrl-C): SIGINT first so runs stop cleanly, then kill.

        Cancelled runs are not recorded as failed: their status stays ``running`` and the
        next sweep resumes them from their newest checkpoint.
        """
        for proc, _, _ in self._procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        for proc, _, log in self._procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
        self._procs.clear()

    def close(self) -> None:
        self.cancel()


# Ray takes the loopback address as the node's own only when its "cluster" mode is off (the
# mode it uses on macOS/Windows); read once, when ray's constants are imported.
_RAY_LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise QKGeomError("the ray backend needs Ray: pip install 'qkgeom[ray]' "
                          "(or pip install ray)") from None
    return ray


def _loopback_only(ray: Any) -> None:
    """Keep the local instance about to start on 127.0.0.1: ray otherwise resolves
    "127.0.0.1" to the machine's network address, and its servers then listen on every
    interface. The switch is read when ray is imported, so the module's copy is set too."""
    os.environ[_RAY_LOCAL_ONLY] = "0"  # for the processes ray.init starts
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
        constants.ENABLE_RAY_CLUSTER = False


def _ray_run_one(run_dir: str, config_dict: dict[str, Any], threads: int,
                 retry_failed: bool) -> dict[str, Any]:
    """The Ray task: ``run_one`` with the run's prints in its worker.log, as locally."""
    from qkgeom.experiments.worker import run_one

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(run_dir) / WORKER_LOG, "a", encoding="utf-8") as log, \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        return run_one(run_dir, config_dict, threads, retry_failed=retry_failed)


class RayBackend:
    """One Ray task per run on the cluster at ``address`` (None: a local Ray instance on
    127.0.0.1); a task whose worker dies is retried up to ``retries`` times."""

    def __init__(self, address: str | None, retries: int = 0) -> None:
        ray = _ray()
        self._ray = ray
        self._owns = not ray.is_initialized()
        if self._owns:
            kwargs: dict[str, Any] = {"log_to_driver": False}
            if address is None:
                kwargs.update(include_dashboard=False, _node_ip_address="127.0.0.1")
                _loopback_only(ray)
            try:
                ray.init(address=address, **kwargs)
            except ConnectionError as err:
                raise QKGeomError(f"cannot connect to Ray at {address!r}: {err}") from None
        self._task = ray.remote(max_calls=1, max_retries=retries)(_ray_run_one)
        self._refs: dict[Any, Path] = {}

    def submit(self, run_dir: Path, config_dict: dict[str, Any], threads: int,
               retry_failed: bool) -> None:
        options: dict[str, Any] = {"num_cpus": threads}
        if str(config_dict.get("device", "cpu")).startswith("cuda"):
            options["num_gpus"] = 1
        ref = self._task.options(**options).remote(str(run_dir), config_dict, threads,
                                                   retry_failed)
        self._refs[ref] = run_dir

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        if not self._refs:
            time.sleep(timeout)
            return []
        ready, _ = self._ray.wait(list(self._refs), num_returns=1, timeout=timeout)
        if ready:  # collect everything else that is ready too
            ready, _ = self._ray.wait(list(self._refs), num_returns=len(self._refs), timeout=0)
        results = []
        for ref in ready:
            run_dir = self._refs.pop(ref)
            try:
                results.append(self._ray.get(ref))
            except Exception as err:  # a crashed worker, a lost node, a task error
                from qkgeom.experiments.worker import one_line

                results.append(crashed(run_dir, f"ray task failed: {one_line(err)}"))
        return results

    def cancel(self) -> None:
        for ref in self._refs:
            with contextlib.suppress(Exception):
                self._ray.cancel(ref, force=True)
        self._refs.clear()

    def close(self) -> None:
        self.cancel()
        if self._owns:
            self._ray.shutdown()
