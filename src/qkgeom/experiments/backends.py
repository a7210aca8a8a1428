"""Where a sweep's runs execute: local worker processes or Ray tasks, both calling ``run_one``.

A backend only starts runs and reports finished ones; skipping, locking and recording are
:func:`~qkgeom.experiments.worker.run_one`'s, the same for both. **Local**: persistent
worker processes (:mod:`~qkgeom.experiments.pool`), on a CUDA grid each pinned to the GPU
with the fewest runs. **Ray**: one task per run asking for its threads (and
``1/runs_per_gpu`` of a GPU), retried ``retries`` times when its worker dies; a local Ray
instance qkgeom starts listens on 127.0.0.1 only. Details: docs/sweeps.md#at-scale-ray.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Protocol

from qkgeom.errors import QKGeomError
from qkgeom.experiments.pool import WorkerPool
from qkgeom.experiments.worker import record_failure, result_of
from qkgeom.io import append_file, make_dir
from qkgeom.runs import one_line
from qkgeom.runs.sweep import WORKER_LOG

BACKENDS = ("local", "ray")


class Backend(Protocol):
    def submit(self, run_dir: Path, config_dict: dict[str, Any], threads: int,
               retry_failed: bool) -> None: ...

    def wait(self, timeout: float) -> list[dict[str, Any]]: ...

    def cancel(self, signum: int = signal.SIGINT) -> None: ...

    def close(self) -> None: ...


def make_backend(name: str, address: str | None = None, retries: int = 0, *,
                 runs_per_gpu: int = 1, gpus: list[str] | None = None,
                 max_runs_per_worker: int | None = None) -> Backend:
    """The backend called ``name``; Ray is imported (and connected) only when asked for.
    ``gpus`` (local): the CUDA device ids to spread runs over; ``max_runs_per_worker``
    (local): runs per worker process (None: no limit, 1: a fresh process per run)."""
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise QKGeomError(f"--retries must be a whole number >= 0, got {retries!r}")
    if name == "local":
        if address is not None:
            raise QKGeomError("--address is for the ray backend; the local backend has none")
        if retries:
            raise QKGeomError("--retries is for the ray backend; locally, run the sweep again "
                              "(it resumes interrupted runs)")
        return LocalBackend(gpus, max_runs_per_worker)
    if name == "ray":
        return RayBackend(address, retries, runs_per_gpu)
    raise QKGeomError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


def crashed(run_dir: Path, message: str) -> dict[str, Any]:
    """Record (under the run's lock) and report a worker that died without a result."""
    record_failure(run_dir, message)
    return result_of(run_dir, "failed", "crashed", {"error": message})


class LocalBackend:
    """Persistent worker processes on this machine; CUDA runs on the least-loaded of
    ``gpus``."""

    def __init__(self, gpus: list[str] | None = None,
                 max_runs_per_worker: int | None = None) -> None:
        self._pool = WorkerPool(max_runs_per_worker)
        self._gpus = list(gpus or [])
        self._placed: dict[str, str | None] = {}  # run_id -> the GPU it runs on

    def submit(self, run_dir: Path, config_dict: dict[str, Any], threads: int,
               retry_failed: bool) -> None:
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        gpu = self._place(str(config_dict.get("device", "cpu")))
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        self._placed[run_dir.name] = gpu
        self._pool.start(run_dir, {"config": config_dict, "threads": threads,
                                   "retry_failed": retry_failed}, key=(threads, gpu), env=env)

    def capacity(self, on_cuda: bool, runs_per_gpu: int) -> int | None:
        """Runs at once this machine takes: ``runs_per_gpu`` per visible GPU on a CUDA
        grid; None (no limit of its own) otherwise."""
        return len(self._gpus) * runs_per_gpu if on_cuda and self._gpus else None

    def _place(self, device: str) -> str | None:
        """The GPU with the fewest runs of this sweep, for a run on ``cuda``; None for CPU
        runs and runs that name their device (``cuda:1``)."""
        if device != "cuda" or not self._gpus:
            return None
        busy = list(self._placed.values())
        return min(self._gpus, key=busy.count)

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        """Results of the runs that finished within ``timeout`` seconds (maybe none)."""
        results = []
        for run_dir, result, why in self._pool.wait(timeout):
            self._placed.pop(run_dir.name, None)
            results.append(result if result is not None else crashed(
                run_dir, f"worker process died ({why}) without recording a result; see "
                         f"{run_dir / WORKER_LOG}"))
        return results

    def cancel(self, signum: int = signal.SIGINT) -> None:
        """Stop every running worker, the signal passed on: cancelled runs record
        ``interrupted`` (not failed), and the next sweep resumes them."""
        self._pool.cancel(signum)
        self._placed.clear()

    def close(self) -> None:
        self._pool.close()
        self._placed.clear()


def connect_ray(address: str | None) -> tuple[Any, bool]:
    """``(ray, owns)``: Ray connected to the cluster at ``address`` (None: a local instance
    on 127.0.0.1 only, no dashboard); ``owns``: this call connected, so its caller shuts
    the connection down."""
    try:
        import ray
    except ImportError:
        raise QKGeomError("the ray backend needs Ray: pip install 'qkgeom[ray]' "
                          "(or pip install ray)") from None
    if ray.is_initialized():
        return ray, False
    # Ray's INFO lines stay out of the command's output (its result, or its one error line)
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address is None:
        kwargs.update(include_dashboard=False, _node_ip_address="127.0.0.1")
        # Ray resolves 127.0.0.1 to the network address (and listens on every interface)
        # unless its "cluster" mode is off: read when ray is imported, so set it there too
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
        if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
            constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address=address, **kwargs)
    except Exception as err:  # a refused connection, an address Ray cannot parse ...
        first = " ".join((str(err).strip().splitlines() or [""])[0].split())[:200]
        raise QKGeomError(f"cannot connect to Ray at {address!r} ({type(err).__name__}: "
                          f"{first}); pass --address auto or host:port of a running Ray "
                          "cluster, or leave it out for a local one") from None
    return ray, True


def _ray_run_one(run_dir: str, config_dict: dict[str, Any], threads: int,
                 retry_failed: bool) -> dict[str, Any]:
    """The Ray task: ``run_one`` with the run's prints in its worker.log, as locally."""
    from qkgeom.experiments.worker import run_one

    try:
        make_dir(run_dir)
        raw = append_file(Path(run_dir) / WORKER_LOG)  # never through a planted link
    except QKGeomError as err:
        return result_of(Path(run_dir), "failed", "refused", {"error": one_line(err)})
    with io.TextIOWrapper(raw, encoding="utf-8", write_through=True) as log, \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        return run_one(run_dir, config_dict, threads, retry_failed=retry_failed)


class RayBackend:
    """One Ray task per run on the cluster at ``address`` (None: a local instance)."""

    def __init__(self, address: str | None, retries: int = 0, runs_per_gpu: int = 1) -> None:
        self._ray, self._owns = connect_ray(address)
        # CPU runs reuse Ray's worker processes; a GPU run gets a fresh one (max_calls=1):
        # a process cannot move its CUDA context to the GPU Ray assigns the next task.
        self._task = self._ray.remote(max_retries=retries)(_ray_run_one)
        self._gpu_task = self._ray.remote(max_retries=retries, max_calls=1)(_ray_run_one)
        self._gpu_share = 1.0 / runs_per_gpu  # Ray's num_gpus of one run on a shared GPU
        self._refs: dict[Any, Path] = {}

    def submit(self, run_dir: Path, config_dict: dict[str, Any], threads: int,
               retry_failed: bool) -> None:
        options: dict[str, Any] = {"num_cpus": threads}
        task = self._task
        device = str(config_dict.get("device", "auto"))
        # device auto: a GPU share when the cluster has GPUs (the worker then picks cuda)
        if device.startswith("cuda") or (device == "auto" and self._resources("GPU") > 0):
            options["num_gpus"] = self._gpu_share
            task = self._gpu_task
        ref = task.options(**options).remote(str(run_dir), config_dict, threads, retry_failed)
        self._refs[ref] = run_dir

    def _resources(self, kind: str) -> float:
        return self._ray.cluster_resources().get(kind, 0)

    def check_fits(self, threads: int, on_cuda: bool) -> None:
        """Refuse in one line runs asking for more CPUs (``threads``) or GPUs than the whole
        cluster has: Ray would keep them pending for ever."""
        cpus, gpus = self._resources("CPU"), self._resources("GPU")
        if threads > cpus:
            raise QKGeomError(f"each run asks Ray for {threads} CPUs (--threads) but the whole "
                              f"cluster has {cpus:g}; lower --threads (at most {int(cpus)})")
        if on_cuda and gpus < self._gpu_share:
            raise QKGeomError(f"the grid trains on CUDA but the Ray cluster has {gpus:g} GPUs; "
                              "add GPU nodes or train with --set device=cpu")

    def capacity(self, on_cuda: bool, runs_per_gpu: int) -> int | None:
        """Runs at once the cluster takes now: its GPUs x ``runs_per_gpu`` on a CUDA grid,
        else its CPUs (one thread per run)."""
        n = self._resources("GPU") * runs_per_gpu if on_cuda else self._resources("CPU")
        return max(1, int(n)) if n else None

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
                results.append(crashed(run_dir, f"ray task failed: {one_line(err)}"))
        return results

    def cancel(self, signum: int = signal.SIGINT) -> None:
        for ref in self._refs:
            with contextlib.suppress(Exception):
                self._ray.cancel(ref, force=True)
        self._refs.clear()

    def close(self) -> None:
        self.cancel()
        if self._owns:
            self._ray.shutdown()
