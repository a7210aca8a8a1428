"""Where a sweep's runs execute: local worker processes or Ray tasks, both calling ``run_one``.

A backend only starts runs and reports finished ones; skipping, locking and recording are
:func:`~qkgeom.experiments.worker.run_one`'s job, identical for both (docs/sweeps.md).
**Local**: persistent worker processes (:mod:`~qkgeom.experiments.pool`); on a CUDA grid
each is pinned to the GPU with the fewest runs, ``runs_per_gpu`` to a GPU. **Ray**: one
task per run asking for its threads (and ``1/runs_per_gpu`` of a GPU: Ray's fractional GPUs
pack them), retried up to ``retries`` times when its worker dies (the retry resumes from
the newest checkpoint under the run's lock); the sweep folder must be on a filesystem every
node sees. A local instance qkgeom starts listens on 127.0.0.1 only, and a run asking for
more than the whole cluster has is refused in one line (it would wait for ever).
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

    ``runs_per_gpu`` (Ray: ``num_gpus=1/runs_per_gpu`` per CUDA run), ``gpus`` (local:
    the CUDA device ids to spread runs over) and ``max_runs_per_worker`` (local: runs per
    worker process, None for no limit) are described in the module docstring.
    """
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
    """Persistent worker processes on this machine (:class:`~qkgeom.experiments.pool.WorkerPool`).

    ``gpus``: the CUDA device ids runs of device ``cuda`` are spread over (least-loaded
    first; each worker pinned to one); ``max_runs_per_worker``: None keeps workers for
    the whole sweep, 1 starts a fresh process per run.
    """

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
        """Runs at once this machine takes for a grid: ``runs_per_gpu`` per visible GPU on
        a CUDA grid; None (no limit of its own) otherwise."""
        return len(self._gpus) * runs_per_gpu if on_cuda and self._gpus else None

    def _place(self, device: str) -> str | None:
        """The GPU with the fewest runs of this sweep on it, for a run on ``cuda``; None for
        CPU runs and runs that name their device (``cuda:1``)."""
        if device != "cuda" or not self._gpus:
            return None
        busy = list(self._placed.values())
        return min(self._gpus, key=busy.count)

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        """Results of the runs that finished within ``timeout`` seconds (maybe none)."""
        results = []
        for run_dir, result, why in self._pool.wait(timeout):
            self._placed.pop(run_dir.name, None)
            if result is None:
                result = crashed(run_dir, f"worker process died ({why}) without recording a "
                                          f"result; see {run_dir / WORKER_LOG}")
            results.append(result)
        return results

    def cancel(self, signum: int = signal.SIGINT) -> None:
        """Stop every running worker (Ctrl-C, SIGTERM): the signal passed on so runs stop
        cleanly, waited for, then killed if they have not ended.

        Cancelled runs are not recorded as failed: their status says ``interrupted`` (or
        ``running`` after a kill) and the next sweep resumes them from their newest
        checkpoint.
        """
        self._pool.cancel(signum)
        self._placed.clear()

    def close(self) -> None:
        self._pool.close()
        self._placed.clear()


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


def connect_ray(address: str | None) -> tuple[Any, bool]:
    """``(ray, owns)``: Ray connected to the cluster at ``address`` (None: a local instance
    on 127.0.0.1 only, no dashboard); ``owns`` says this call started the connection, so
    its caller shuts it down."""
    ray = _ray()
    if ray.is_initialized():
        return ray, False
    # Ray's own INFO lines ("Connecting to existing Ray cluster ...") stay out of the
    # command's output: its result, or its one error line
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address is None:
        kwargs.update(include_dashboard=False, _node_ip_address="127.0.0.1")
        _loopback_only(ray)
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
    """One Ray task per run on the cluster at ``address`` (None: a local Ray instance on
    127.0.0.1); a task whose worker dies is retried up to ``retries`` times; a CUDA run
    takes ``1/runs_per_gpu`` of a GPU."""

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
        if device.startswith("cuda") or (device == "auto" and self._cluster_has_gpus()):
            options["num_gpus"] = self._gpu_share
            task = self._gpu_task
        ref = task.options(**options).remote(str(run_dir), config_dict, threads, retry_failed)
        self._refs[ref] = run_dir

    def _cluster_has_gpus(self) -> bool:
        """``device: auto`` on a cluster: a run asks for a GPU share when the cluster has
        GPUs (the worker then resolves auto to cuda), else it runs on CPUs."""
        return self._ray.cluster_resources().get("GPU", 0) > 0

    def check_fits(self, threads: int, on_cuda: bool) -> None:
        """Refuse, in one line, runs that ask for more of a resource than the whole cluster
        has (Ray would keep them pending for ever): ``threads`` CPUs per run, and a GPU
        share for a CUDA grid."""
        resources = self._ray.cluster_resources()
        cpus, gpus = resources.get("CPU", 0), resources.get("GPU", 0)
        if threads > cpus:
            raise QKGeomError(f"each run asks Ray for {threads} CPUs (--threads) but the whole "
                              f"cluster has {cpus:g}; lower --threads (at most {int(cpus)})")
        if on_cuda and gpus < self._gpu_share:
            raise QKGeomError(f"the grid trains on CUDA but the Ray cluster has {gpus:g} GPUs; "
                              "add GPU nodes or train with --set device=cpu")

    def capacity(self, on_cuda: bool, runs_per_gpu: int) -> int | None:
        """Runs at once the cluster takes now: its GPUs x ``runs_per_gpu`` on a CUDA grid,
        else its CPUs (one thread per run)."""
        resources = self._ray.cluster_resources()
        n = resources.get("GPU", 0) * runs_per_gpu if on_cuda else resources.get("CPU", 0)
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
