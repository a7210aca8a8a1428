"""Run a grid into a sweep folder: skip what is done, resume what was cut, record the rest.

:func:`run_sweep` is safe to rerun and to run twice at once on one folder: every run trains
under its own lock, the skip rule is :func:`qkgeom.runs.finished_state`, and a run another
process holds is counted ``locked``, not waited for. A run that depends on another (an
arm's reference) starts once that one is ``done``. Layout and defaults: docs/sweeps.md.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from qkgeom.errors import Interrupted, QKGeomError
from qkgeom.experiments.backends import BACKENDS, make_backend
from qkgeom.experiments.grid import Grid, RunSpec
from qkgeom.experiments.packing import parse_runs_per_gpu, runs_per_gpu_for
from qkgeom.experiments.progress import sweep_view
from qkgeom.experiments.worker import record_failure
from qkgeom.io import make_dir, write_json
from qkgeom.runs import FolderLock, finished_state, lock_is_held, read_status, status_of
from qkgeom.runs.sweep import RUNS_DIR, SWEEP_FILE, read_sweep_record, refuse_sweep_links, run_dir
from qkgeom.version import __version__

STATES = ("done", "diverged", "failed", "locked", "pending")
_POLL_S = 0.5
MAX_THREADS = 4096  # the config's own bound on torch threads


@dataclass
class SweepSummary:
    """What one :func:`run_sweep` call ended with: ``counts`` of runs per state (locked:
    held by another process; pending: not reached, or waiting on a run another process
    holds), ``trained`` the ids this call trained or resumed, ``wall_s`` its seconds."""

    out_dir: Path
    counts: dict[str, int]
    wall_s: float
    states: dict[str, str] = field(default_factory=dict)
    trained: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Every run finished, and none failed (diverged runs are results, not failures)."""
        return not (self.counts["failed"] or self.counts["locked"] or self.counts["pending"])

    def __str__(self) -> str:
        counts = ", ".join(f"{k} {v}" for k, v in self.counts.items() if v)
        return f"sweep {self.out_dir}: {counts or 'no runs'} in {self.wall_s:.1f} s"


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def run_sweep(
    grid: Grid,
    out_dir: str | Path,
    *,
    workers: int | None = 1,
    backend: str = "local",
    address: str | None = None,
    threads_per_run: int | None = None,
    progress: bool = True,
    retry_failed: bool = False,
    retries: int = 0,
    runs_per_gpu: int | str = 1,
    max_runs_per_worker: int | None = None,
) -> SweepSummary:
    """Train every run of ``grid`` into ``out_dir/runs/<run_id>`` (options: docs/sweeps.md;
    ``max_runs_per_worker``, local: runs a worker process trains before it is replaced).

    Everything is checked before any work (a one-line :class:`QKGeomError`): the arguments,
    every run's config and data, the backend, and that ``out_dir/sweep.json``, if there,
    records this same grid.
    """
    t0 = time.perf_counter()
    _check_arguments(workers, threads_per_run, max_runs_per_worker, backend)
    per_gpu = parse_runs_per_gpu(runs_per_gpu)
    out = Path(out_dir)
    specs = _checked_specs(grid, out, backend)
    on_cuda = any(s.config.device.startswith("cuda") for s in specs)
    gpus = cuda_devices() if on_cuda and backend == "local" else []
    if per_gpu == "auto":
        per_gpu = runs_per_gpu_for(out, specs[0], backend, address, gpus, threads_per_run) \
            if on_cuda else 1
    runner = make_backend(backend, address, retries, runs_per_gpu=per_gpu, gpus=gpus,
                          max_runs_per_worker=max_runs_per_worker)
    try:
        workers = sweep_workers(workers, specs, runner, on_cuda=on_cuda, runs_per_gpu=per_gpu,
                                local=backend == "local")
        threads = threads_per_run or max(1, available_cpus() // workers)
        if hasattr(runner, "check_fits"):
            runner.check_fits(threads, on_cuda)
        write_sweep_file(out, grid, specs)
        return _schedule(specs, out, runner, workers=workers, threads=threads,
                         retry_failed=retry_failed, progress=progress, title=grid.name, t0=t0)
    except KeyboardInterrupt as err:  # SIGINT / SIGTERM: passed on to the runs, waited for
        signum = err.signum if isinstance(err, Interrupted) else signal.SIGINT
        runner.cancel(signum)
        raise Interrupted(signum, f"interrupted ({signal.Signals(signum).name}); the runs in "
                                  "flight were stopped and recorded where they stopped: run "
                                  "the same command again to resume them") from None
    except BaseException:
        runner.cancel()
        raise
    finally:
        runner.close()


def _check_arguments(workers: int | None, threads_per_run: int | None,
                     max_runs_per_worker: int | None, backend: str) -> None:
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise QKGeomError(f"workers must be a positive integer, got {workers!r}")
    if threads_per_run is not None and (not isinstance(threads_per_run, int)
                                        or not 1 <= threads_per_run <= MAX_THREADS):
        raise QKGeomError(f"--threads must be a whole number in [1, {MAX_THREADS}] (torch "
                          f"threads per run), got {threads_per_run!r}")
    if max_runs_per_worker is not None and (not isinstance(max_runs_per_worker, int)
                                            or max_runs_per_worker < 1):
        raise QKGeomError("max_runs_per_worker must be a positive integer or None, got "
                          f"{max_runs_per_worker!r}")
    if backend not in BACKENDS:
        raise QKGeomError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def _checked_specs(grid: Grid, out: Path, backend: str) -> list[RunSpec]:
    """The grid's runs with their data resolved, once ``out`` is known to be a folder
    holding no planted link and no other grid: before connecting to anything."""
    specs = resolve_data(grid.expand())
    if backend == "local":  # device auto means this machine's device (Ray: each worker's)
        specs = [on_this_machine(s) for s in specs]
    if out.exists() and not out.is_dir():
        raise QKGeomError(f"{out} exists and is not a folder")
    refuse_sweep_links(out, [s.run_id for s in specs])  # a planted link: refused, untouched
    check_sweep_file(out, grid, specs)
    return specs


def cuda_devices() -> list[str]:
    """The CUDA device ids this process sees, as ``CUDA_VISIBLE_DEVICES`` names them for
    its children (none without CUDA)."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible is not None \
        else [str(i) for i in range(n)]
    return ids[:n]


def sweep_workers(workers: int | None, specs: list[RunSpec], runner: Any, *, on_cuda: bool,
                  runs_per_gpu: int, local: bool) -> int:
    """Runs at once: ``workers`` as given, or the default for the grid from the backend's
    capacity; a local CUDA grid never more than its GPUs' slots."""
    capacity = getattr(runner, "capacity", None)
    cap = capacity(on_cuda, runs_per_gpu) if capacity is not None else None
    if workers is None:
        return cap or (runs_per_gpu if on_cuda else max(1, min(available_cpus(), len(specs))))
    return min(workers, cap) if cap and on_cuda and local else workers


def on_this_machine(spec: RunSpec) -> RunSpec:
    """``spec`` with ``device: auto`` resolved here, so that placement and packing see the
    device the run will use (the config hash leaves the device out)."""
    if spec.config.device != "auto":
        return spec
    from qkgeom.config import detect_device

    return dataclasses.replace(spec, config=dataclasses.replace(spec.config,
                                                                device=detect_device()))


def resolve_data(specs: list[RunSpec]) -> list[RunSpec]:
    """The specs with ``model.vocab_size`` set from their data, each data folder opened
    once here: a missing or short corpus fails the sweep before any run, the sample is
    prepared once, and sweep.json records the hashes the trainer writes."""
    from qkgeom.config import with_vocab
    from qkgeom.data import load_data

    loaded: dict[str, Any] = {}
    out = []
    for spec in specs:
        cfg = spec.config
        if cfg.data not in loaded:
            loaded[cfg.data] = load_data(cfg.data)
        loaded[cfg.data].require_block(cfg.model.block_size)
        out.append(dataclasses.replace(
            spec, config=with_vocab(cfg, loaded[cfg.data].vocab.vocab_size)))
    return out


def _schedule(specs: list[RunSpec], out: Path, runner: Any, *, workers: int, threads: int,
              retry_failed: bool, progress: bool, title: str, t0: float) -> SweepSummary:
    """Keep ``workers`` runs going (dependencies first), collect results, refresh the view."""
    waiting = list(specs)  # in grid order; a run leaves when started or settled
    states: dict[str, str] = {}
    in_flight: set[str] = set()
    trained: list[str] = []
    view = sweep_view(title, {s.run_id: s.config.steps for s in specs}) if progress else None
    try:
        while waiting or in_flight:
            _settle_blocked(waiting, states, out, retry_failed)
            while len(in_flight) < workers:
                spec = next((s for s in waiting if _ready(s, states)), None)
                if spec is None:
                    break
                waiting.remove(spec)
                folder = run_dir(out, spec.run_id)
                known = _precheck(folder, retry_failed)
                if known is not None:
                    states[spec.run_id] = known
                    continue
                config = dataclasses.replace(spec.config, threads=threads).to_dict()
                runner.submit(folder, config, threads, retry_failed)
                in_flight.add(spec.run_id)
            if not in_flight and waiting and not any(_ready(s, states) for s in waiting):
                _settle_blocked(waiting, states, out, retry_failed)
                if not any(_ready(s, states) for s in waiting):
                    break  # everything left waits on runs this process cannot finish
                continue
            for result in runner.wait(_POLL_S) if in_flight else []:
                in_flight.discard(result["run_id"])
                states[result["run_id"]] = result["state"]
                if result["action"] in ("trained", "resumed"):
                    trained.append(result["run_id"])
            if view is not None:
                view.update(_live_states(specs, out, states, in_flight))
    finally:
        if view is not None:
            view.close()
    final = {s.run_id: states.get(s.run_id, "pending") for s in specs}
    return SweepSummary(out_dir=out, counts={k: sum(v == k for v in final.values())
                                             for k in STATES},
                        wall_s=time.perf_counter() - t0, states=final, trained=trained)


def _ready(spec: RunSpec, states: dict[str, str]) -> bool:
    """Whether ``spec`` may start: no dependency, or its reference run is done."""
    return not spec.depends_on or states.get(spec.depends_on) == "done"


def _settle_blocked(waiting: list[RunSpec], states: dict[str, str], out: Path,
                    retry_failed: bool) -> None:
    """Settle the runs whose reference ended without being done, repeatedly (a chain
    settles at once): ``failed`` with the reason when it diverged or failed, ``pending``
    when another process holds it or it is itself pending."""
    changed = True
    while changed:
        changed = False
        for spec in list(waiting):
            ref_state = states.get(spec.depends_on) if spec.depends_on else None
            if ref_state is None or ref_state == "done":
                continue
            waiting.remove(spec)
            changed = True
            folder = run_dir(out, spec.run_id)
            known = _precheck(folder, retry_failed)
            if known is not None:  # finished before, or held by another process
                states[spec.run_id] = known
            elif ref_state in ("diverged", "failed"):
                record_failure(folder, f"reference run {spec.depends_on} {ref_state}")
                states[spec.run_id] = "failed"
            else:
                states[spec.run_id] = "pending"


def _precheck(folder: Path, retry_failed: bool) -> str | None:
    """A run's known outcome without starting a worker (finished, or locked by another);
    the worker checks again under the lock, which is what makes skipping race-free."""
    state = finished_state(read_status(folder), retry_failed)
    return state or ("locked" if lock_is_held(folder) else None)


def _live_states(specs: list[RunSpec], out: Path, states: dict[str, str],
                 in_flight: set[str]) -> dict[str, tuple[str, int]]:
    live: dict[str, tuple[str, int]] = {}
    for rid in (s.run_id for s in specs):
        if rid in in_flight or states.get(rid) == "locked":
            step = int((read_status(run_dir(out, rid)) or {}).get("step", 0))
            live[rid] = ("running" if rid in in_flight else "locked", step)
        else:
            live[rid] = (states.get(rid, "pending"), 0)
    return live


def _sweep_record(grid: Grid, specs: list[RunSpec]) -> dict[str, Any]:
    return {
        "grid": json.loads(json.dumps(grid.to_dict())),
        "runs": [{"run_id": s.run_id, "axes": s.axes, "config_hash": s.config_hash,
                  "steps": s.config.steps, **({"depends_on": s.depends_on}
                                              if s.depends_on else {})} for s in specs],
    }


def check_sweep_file(out: Path, grid: Grid, specs: list[RunSpec]) -> None:
    """Refuse a sweep folder that records another grid (or other configs for this one)."""
    path = out / SWEEP_FILE
    if not path.exists():
        if (out / RUNS_DIR).is_dir() and any((out / RUNS_DIR).iterdir()):
            raise QKGeomError(f"{out} holds runs but no {SWEEP_FILE}; use another folder")
        return
    saved, mine = read_sweep_record(out), _sweep_record(grid, specs)
    if saved["grid"] != mine["grid"]:
        raise QKGeomError(f"{path}: this folder holds sweep {saved['grid'].get('name')!r} with "
                          "a different grid; use another output folder, or the grid it was "
                          "started with")
    old = {r["run_id"]: r.get("config_hash") for r in saved["runs"]}
    new = {r["run_id"]: r["config_hash"] for r in mine["runs"]}
    if old != new:
        changed = sorted(k for k in new if old.get(k) != new[k])
        raise QKGeomError(f"{path}: the same grid now gives different run configs "
                          f"({', '.join(changed[:3]) or 'run ids'} changed: was a preset edited "
                          "or the data prepared again?); use another output folder")


def write_sweep_file(out: Path, grid: Grid, specs: list[RunSpec]) -> None:
    """Create sweep.json once (under a folder lock, so two starters agree), else recheck."""
    make_dir(out)
    with FolderLock(out / ".sweep.lock"):  # never through a planted link
        if (out / SWEEP_FILE).exists():
            check_sweep_file(out, grid, specs)
            return
        write_json(out / SWEEP_FILE, {
            **_sweep_record(grid, specs), "qkgeom_version": __version__,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})


def sweep_status(out_dir: str | Path) -> pd.DataFrame:
    """One row per run: run_id, the axis values (and the size and arm), state, step, steps,
    error, config_hash. ``state``: done | diverged | failed | running (its lock is held) |
    interrupted (started, nobody holds it: the next sweep resumes it) | pending (never
    started) | unreadable (its status is not qkgeom's: the reason is the error)."""
    out = Path(out_dir)
    record = read_sweep_record(out)
    grid = record["grid"]
    axes = [*(["size"] if grid.get("sizes") else []),
            *(grid["axes"] if isinstance(grid.get("axes"), dict) else {}),
            *(["arm"] if grid.get("arms") else [])]
    rows = []
    for run in record["runs"]:
        folder = run_dir(out, run["run_id"])
        status, problem = status_of(folder) if not folder.is_symlink() else (
            None, f"{folder}: is a symbolic link")
        error = (status or {}).get("error")
        if problem:  # one line naming the file; the other runs are listed as usual
            state, step, error = "unreadable", 0, problem
        elif status is None:
            state, step = ("running" if lock_is_held(folder) else "pending"), 0
        else:
            state, step = status["state"], status["step"]
            if state == "running" and not lock_is_held(folder):
                state = "interrupted"
        rows.append({"run_id": run["run_id"], **{k: run.get("axes", {}).get(k) for k in axes},
                     "state": state, "step": step, "steps": int(run.get("steps", 0)),
                     "error": error, "config_hash": run.get("config_hash", "")})
    return pd.DataFrame(rows, columns=["run_id", *axes, "state", "step", "steps", "error",
                                       "config_hash"])


__all__ = ["SweepSummary", "run_sweep", "sweep_status", "available_cpus"]
