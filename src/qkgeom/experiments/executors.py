"""Checkpoint families spread over workers: Ray tasks on a cluster, or local processes.

The executors of :data:`qkgeom.checkpoints.family.Executor`: each job writes its own cache
entry in the analysis folder (which the workers must see), so a rerun measures only what
is missing and the tables are the same however they were measured. ``ray``: one task per
checkpoint (``threads`` CPUs, one GPU on CUDA), at most ``workers`` in flight; ``local``
with ``workers > 1``: that many spawned processes here.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

from qkgeom.errors import QKGeomError

Measure = Callable[[Any], dict[str, Any]]
Outcome = tuple[Any, "dict[str, Any] | BaseException"]


def make_executor(backend: str, *, workers: int | None = None, threads: int = 1,
                address: str | None = None, device: str = "cpu"
                ) -> Callable[[Measure, list[Any]], Iterator[Outcome]] | None:
    """The executor for ``qkgeom analyze --backend/--workers``; None: measure in this process
    (backend ``local`` with at most one worker)."""
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise QKGeomError(f"--workers must be a whole number >= 1, got {workers!r}")
    if not isinstance(threads, int) or threads < 1:
        raise QKGeomError(f"--threads must be a whole number >= 1, got {threads!r}")
    if backend == "local":
        if address is not None:
            raise QKGeomError("--address is for the ray backend; the local backend has none")
        if workers is None or workers == 1:
            return None
        return lambda measure, jobs: _local(measure, jobs, workers, threads)
    if backend == "ray":
        from qkgeom.experiments.backends import connect_ray

        ray, owns = connect_ray(address)  # a bad address or no ray fails now, before any work
        return lambda measure, jobs: _ray(measure, jobs, workers, threads, device, ray, owns)
    raise QKGeomError(f"unknown backend {backend!r}; choose one of local, ray")


def with_threads(measure: Measure, job: Any, threads: int) -> dict[str, Any]:
    """``measure(job)`` with ``threads`` torch threads (what a worker runs)."""
    import torch

    torch.set_num_threads(threads)
    return measure(job)


def _local(measure: Measure, jobs: list[Any], workers: int, threads: int) -> Iterator[Outcome]:
    context = multiprocessing.get_context("spawn")  # no forked torch state
    with ProcessPoolExecutor(max_workers=min(workers, max(len(jobs), 1)),
                             mp_context=context) as pool:
        futures: dict[Future[dict[str, Any]], Any] = {
            pool.submit(with_threads, measure, job, threads): job for job in jobs}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                err = fut.exception()
                yield futures[fut], (err if err is not None else fut.result())


def _ray(measure: Measure, jobs: list[Any], workers: int | None, threads: int, device: str,
         ray: Any, owns: bool) -> Iterator[Outcome]:
    """Tasks on the connected ``ray``; the connection is closed at the end if ``owns``."""
    try:
        options: dict[str, Any] = {"num_cpus": threads, "max_retries": 0}
        if device.startswith("cuda"):
            options["num_gpus"] = 1
        task = ray.remote(**options)(with_threads)
        queue = list(jobs)
        refs: dict[Any, Any] = {}
        while queue or refs:
            while queue and (workers is None or len(refs) < workers):
                job = queue.pop(0)
                refs[task.remote(measure, job, threads)] = job
            ready, _ = ray.wait(list(refs), num_returns=1)
            for ref in ready:
                job = refs.pop(ref)
                try:
                    yield job, ray.get(ref)
                except Exception as err:  # the task's own exception, or a lost worker
                    yield job, getattr(err, "cause", None) or err
    finally:
        if owns:
            ray.shutdown()
