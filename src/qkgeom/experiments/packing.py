"""How many runs to train at once on one device: a measured probe and the rule that picks.

Why: one paper-size run leaves most of a large GPU idle (small matmuls, launch gaps), and
how many runs share it best depends on the model, the GPU and the host, so it is measured.
The probe (:func:`measure_packing`) starts ``k`` processes training the grid's own config,
waits until all are warm, and counts the tokens trained in the window where all ``k`` were
timed (:func:`window_throughput`). The rule (:func:`choose_runs_per_gpu`), fixed before any
measurement: the smallest ``k`` within :data:`NEAR_BEST` of the best summed tokens/s whose
``k x`` memory per run stays under :data:`MEMORY_SHARE` of the device. Details and
measurements: docs/speed.md#runs-packed-per-gpu.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QKGeomError
from qkgeom.experiments.pool import SAFE_PATH
from qkgeom.io import make_dir, read_json, write_json
from qkgeom.runs.sweep import PACKING_FILE

if TYPE_CHECKING:
    from qkgeom.experiments.grid import RunSpec

COUNTS = (1, 2, 4, 8)
CONTEXT_BYTES = 0.75 * 2**30  # a CUDA context per process, beside what torch reserves
MEMORY_SHARE = 0.9  # projected memory of k runs must stay under this share of the device
NEAR_BEST = 0.95  # the smallest k within 5 % of the best summed tokens/s is picked
MIN_GAIN = 1.10  # the ramp stops when doubling k gains less than 10 %
PROBE_WARMUP, PROBE_STEPS = 15, 60
_SYNC_EVERY = 10  # timed-phase timestamps are taken (after a device sync) this often
_BARRIER_S = 900.0


def parse_runs_per_gpu(value: str | int) -> int | str:
    """``auto`` or a whole number >= 1 (``--runs-per-gpu``); QKGeomError otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or n < 1 or str(value).strip() != str(n):
        raise QKGeomError(f"--runs-per-gpu must be auto or a whole number >= 1, got {value!r}")
    return n


@dataclass
class PackingResult:
    """One measured count: ``runs`` processes at once with ``threads`` threads each."""

    runs: int
    threads: int
    tokens_per_s: float  # summed over the runs, inside the common timed window
    memory: float  # bytes per run: the largest peak of one process (+ context on CUDA)
    device_memory: float | None = None  # bytes the device has (CUDA), None on CPU
    ok: bool = True
    error: str = ""

    @property
    def per_run(self) -> float:
        return self.tokens_per_s / self.runs


def window_throughput(traces: list[list[tuple[float, int]]], tokens_per_step: int) -> float:
    """Summed tokens/s of processes timed at once. ``traces``: per process, ``(wall time,
    steps done)`` points of its timed phase. Only the window from the latest start to the
    earliest end counts (steps interpolated linearly); processes that never overlapped
    fall back to all their steps over the whole span."""
    traces = [t for t in traces if len(t) >= 2]
    if not traces:
        raise QKGeomError("the packing probe recorded no timed steps")
    t0 = max(t[0][0] for t in traces)
    t1 = min(t[-1][0] for t in traces)
    if t1 <= t0:
        steps = sum(t[-1][1] - t[0][1] for t in traces)
        span = max(t[-1][0] for t in traces) - min(t[0][0] for t in traces)
        return steps * tokens_per_step / max(span, 1e-9)
    steps = sum(_steps_at(t, t1) - _steps_at(t, t0) for t in traces)
    return steps * tokens_per_step / (t1 - t0)


def _steps_at(trace: list[tuple[float, int]], when: float) -> float:
    for (ta, sa), (tb, sb) in zip(trace, trace[1:], strict=False):
        if ta <= when <= tb:
            return sa + (sb - sa) * (when - ta) / max(tb - ta, 1e-12)
    return float(trace[0][1] if when < trace[0][0] else trace[-1][1])


def fits(runs: int, memory: float, memory_total: float | None) -> bool:
    """Whether ``runs`` runs of ``memory`` bytes each fit the device (unknown: yes)."""
    return memory_total is None or runs * memory <= MEMORY_SHARE * memory_total


def choose_runs_per_gpu(results: list[PackingResult], memory_total: float | None) -> int:
    """The rule of the module docstring; 1 when nothing measured fits."""
    usable = [r for r in results if r.ok and fits(r.runs, r.memory, memory_total)]
    if not usable:
        return 1
    best = max(r.tokens_per_s for r in usable)
    return min(r.runs for r in usable if r.tokens_per_s >= NEAR_BEST * best)


def measure_packing(config: dict[str, Any], runs: int, *, threads: int = 1,
                    warmup: int = PROBE_WARMUP, steps: int = PROBE_STEPS,
                    env: dict[str, str] | None = None, timeout: float = 900.0
                    ) -> PackingResult:
    """Train ``runs`` copies of ``config`` at once in fresh processes, ``env`` on top of
    this one's. A process that fails (out of memory, say) gives ``ok=False`` with its last
    line of output as ``error``; nothing is raised for it."""
    config = dict(config, threads=threads)
    child_env = {**os.environ, **SAFE_PATH, "OMP_NUM_THREADS": str(threads),
                 "MKL_NUM_THREADS": str(threads), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="qkgeom-packing-") as tmp:
        folder = Path(tmp)
        procs = [subprocess.Popen(
            [sys.executable, "-m", "qkgeom.experiments", "probe", "--config", json.dumps(config),
             "--warmup", str(warmup), "--steps", str(steps), "--barrier", str(folder / "barrier"),
             "--runs", str(runs), "--out", str(folder / f"out-{i}.json"),
             "--run-dir", str(folder / f"run-{i}")], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=child_env, text=True)
            for i in range(runs)]
        errors = []
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                err = f"timed out after {timeout:.0f} s"
            if proc.returncode != 0:
                errors.append((err or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"])
        outs = [json.loads(p.read_text()) for p in sorted(folder.glob("out-*.json"))]
    if errors or len(outs) != runs:
        why = errors[0][0] if errors else "a probe process wrote no result"
        return PackingResult(runs, threads, 0.0, 0.0, ok=False, error=why[:300])
    tokens_per_s = window_throughput([[tuple(p) for p in o["trace"]] for o in outs],
                                     outs[0]["tokens_per_step"])
    memory = max(o["peak_memory"] for o in outs) + (CONTEXT_BYTES if outs[0]["cuda"] else 0)
    return PackingResult(runs, threads, tokens_per_s, memory, outs[0]["device_memory"])


def probe_packing(config: dict[str, Any], *, counts: tuple[int, ...] = COUNTS,
                  threads: int = 1, memory_total: float | None = None,
                  warmup: int = PROBE_WARMUP, steps: int = PROBE_STEPS,
                  env: dict[str, str] | None = None,
                  log: Callable[[str], None] | None = None) -> tuple[int, list[PackingResult]]:
    """Measure ``counts`` in turn and pick one: ``(runs per GPU, every measurement)``.
    The ramp stops when the next count would not fit, a count fails, or doubling gained
    less than :data:`MIN_GAIN`; ``memory_total`` defaults to the first device's."""
    results: list[PackingResult] = []
    for k in counts:
        if results and not fits(k, results[0].memory, memory_total):
            break
        result = measure_packing(config, k, threads=threads, warmup=warmup, steps=steps,
                                 env=env)
        results.append(result)
        memory_total = memory_total or result.device_memory
        if log is not None:
            log(describe(result))
        if not result.ok or (len(results) > 1
                             and result.tokens_per_s < MIN_GAIN * results[-2].tokens_per_s):
            break
    return choose_runs_per_gpu(results, memory_total), results


def describe(r: PackingResult) -> str:
    if not r.ok:
        return f"{r.runs} run(s) at once: failed ({r.error})"
    return (f"{r.runs} run(s) at once x {r.threads} thread(s): {r.tokens_per_s:,.0f} tokens/s "
            f"summed ({r.per_run:,.0f} per run), {r.memory / 2**30:.2f} GiB per run")


def probe_packing_record(config: dict[str, Any], threads: int,
                         env: dict[str, str] | None) -> dict[str, Any]:
    """:func:`probe_packing` as ``packing.json`` records it: the pick, the host, the rule
    and every measurement. Runs where the GPU is (a Ray task on a cluster)."""
    choice, results = probe_packing(config, threads=threads, env=env)
    return {"runs_per_gpu": choice, "host": socket.gethostname(),
            "rule": f"smallest k within {NEAR_BEST:.0%} of the best summed tokens/s, "
                    f"k x memory <= {MEMORY_SHARE:.0%} of the device",
            "results": [dataclasses.asdict(r) for r in results]}


def runs_per_gpu_for(out: Path, spec: RunSpec, backend: str, address: str | None,
                     gpus: list[str], threads: int | None) -> int:
    """``--runs-per-gpu auto``: the number ``out/packing.json`` records for ``spec``'s
    config, else measured now on one GPU (this machine's, or one Ray task's) and recorded."""
    path = out / PACKING_FILE
    if path.is_file():
        saved = read_json(path)
        if isinstance(saved, dict) and saved.get("config_hash") == spec.config_hash \
                and isinstance(saved.get("runs_per_gpu"), int) and saved["runs_per_gpu"] >= 1:
            return int(saved["runs_per_gpu"])
    config, threads = spec.config.to_dict(), threads or 1
    if backend == "ray":
        from qkgeom.experiments.backends import connect_ray

        ray, owns = connect_ray(address)
        try:
            task = ray.remote(num_gpus=1, num_cpus=threads)(probe_packing_record)
            record = ray.get(task.remote(config, threads, None))
        finally:
            if owns:
                ray.shutdown()
    elif not gpus:
        raise QKGeomError("--runs-per-gpu auto needs a CUDA device on this machine; none is "
                          "visible")
    else:
        record = probe_packing_record(config, threads, {"CUDA_VISIBLE_DEVICES": gpus[0]})
    make_dir(out)
    write_json(path, {"config_hash": spec.config_hash, "run_id": spec.run_id, **record})
    return int(record["runs_per_gpu"])


# ------------------------------------------------------------------ the probe process


def _clock(warmup: int, total: int, barrier: Path, runs: int, trace: list) -> Any:
    """A trainer callback: sync and wait at the barrier after ``warmup`` steps, then take
    a (wall time, step) point every few steps of the timed phase."""
    import torch

    from qkgeom.training import Callback

    def sync(model: Any) -> None:
        if next(model.parameters()).is_cuda:
            torch.cuda.synchronize()

    class Clock(Callback):
        def on_step_end(self, ctx: Any) -> None:
            s = ctx.step
            if s == warmup:
                sync(ctx.model)
                barrier.mkdir(parents=True, exist_ok=True)
                (barrier / f"{os.getpid()}").touch()
                deadline = time.monotonic() + _BARRIER_S
                while len(list(barrier.iterdir())) < runs and time.monotonic() < deadline:
                    time.sleep(0.005)
                trace.append((time.time(), s))
            elif s > warmup and (s % _SYNC_EVERY == 0 or s == total):
                sync(ctx.model)
                trace.append((time.time(), s))

    return Clock()


def probe_main(argv: list[str] | None = None) -> int:
    """Child entry (``python -m qkgeom.experiments probe``): one process of a probe."""
    ap = argparse.ArgumentParser(prog="python -m qkgeom.experiments probe")
    for name, kind in (("config", str), ("warmup", int), ("steps", int), ("barrier", Path),
                       ("runs", int), ("out", Path), ("run-dir", Path)):
        ap.add_argument(f"--{name}", type=kind, required=True)
    args = ap.parse_args(argv)
    import resource

    import torch

    from qkgeom.config import from_dict
    from qkgeom.launch import train

    total = args.warmup + args.steps
    cfg = from_dict(json.loads(args.config))
    cfg = dataclasses.replace(cfg, steps=total, probe_every=total, eval_every=total,
                              checkpoint_every=total, checkpoint_schedule="every",
                              warmup_steps=min(cfg.warmup_steps, total))
    trace: list[tuple[float, int]] = []
    train(cfg, args.run_dir, callbacks=[_clock(args.warmup, total, args.barrier, args.runs,
                                                trace)])
    cuda = cfg.device.startswith("cuda")
    peak = (torch.cuda.max_memory_reserved() if cuda  # ru_maxrss: KiB on Linux
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    args.out.write_text(json.dumps({
        "trace": trace, "peak_memory": float(peak), "cuda": cuda,
        "device_memory": float(torch.cuda.mem_get_info()[1]) if cuda else None,
        "tokens_per_step": cfg.batch_size * cfg.model.block_size}))
    return 0
