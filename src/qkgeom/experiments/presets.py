"""The paper's grids: E1 (depths x Q/K inits x seeds) and E3 (seeds x key control).

E1: three sizes of the same structure (depth x ``qk_init`` x seed; every run sees the same
probe set because probes come from the start of the val split):

``smoke``
    depths {1, 2} x 3 inits x 1 seed = 6 runs of the ``smoke`` training preset (40 steps,
    2 heads of width 16, 5 probes). A wiring check, not a result: under a minute with 2
    workers x 1 thread on a 2-core machine.
``demo``
    depths {4, 6, 8} x 3 inits x 2 seeds = 18 runs on the embedded Wikipedia sample with the
    ``demo`` model (4 heads, width 128, context 64) trained for 300 steps of 16 x 64 tokens
    (307 k tokens per run; 11 probes, every 30 steps), so that the whole grid, probes
    included, fits in 15 minutes on 2 CPU cores.
``paper``
    depths {4, 6, 8} x 3 inits x 4 seeds = 36 runs of the ``paper`` training preset on the
    prepared corpus ``data`` (WikiText-103, char level).

E3: for each seed, the runs ``key_control.mode`` ∈ {none, hold, shrink} start from the
same init and see the same batches (the seed fixes both; the control draws no random
numbers), so they are paired by seed. Sizes:

``smoke``
    2 seeds x 3 modes = 6 runs of the ``smoke`` preset (wiring check).
``demo``
    5 seeds x 3 modes = 15 runs of the E1 demo's 4-layer model (normal init) on the embedded
    sample, 300 steps, probed every 25 steps and evaluated every 75, so the early phase
    (first 25 % = 75 steps) has three probes and one validation loss.
``paper``
    5 seeds x 3 modes = 15 runs of the ``paper`` preset (6 layers, normal init) on
    WikiText-103.

Nothing here is tuned to make a claim hold: the demo's sizes were chosen from throughput
alone (tokens/s of the 4-, 6- and 8-layer models on one thread), before looking at results.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkgeom.config import QK_INITS, deep_merge
from qkgeom.errors import QKGeomError
from qkgeom.experiments.grid import Grid, nest_keys
from qkgeom.experiments.runner import SweepSummary, available_cpus, run_sweep

PAPER_DEPTHS = [4, 6, 8]

# preset -> (training preset, overrides for every run, depths, seeds)
E1_PRESETS: dict[str, tuple[str, dict[str, Any], list[int], list[int]]] = {
    # 6 runs x 40 steps. Measured, 2 workers x 1 thread on the 2-core dev machine (its
    # cores shared with another job): 42 s for the grid, about 3 s of it per run is the
    # worker's start.
    "smoke": ("smoke", {}, [1, 2], [0]),
    # 18 runs x 300 steps x 16 x 64 tokens (307 k tokens per run), 11 probes per run (every
    # 30 steps), eval every 100 steps on 4 batches. Sized from throughput alone: 6-10 k
    # tokens/s per run on one thread, i.e. 35-50 s per run. Measured, 2 workers x 1 thread
    # on the 2-core dev machine (cores shared with another job): 433 s (7.2 min) for the
    # grid; with one core fully taken by other work expect up to about twice that.
    "demo": ("demo", {
        "model": {"n_head": 4, "n_embd": 128, "block_size": 64},
        "steps": 300, "batch_size": 16, "warmup_steps": 30, "probe_every": 30,
        "eval_every": 100, "eval_batches": 4, "checkpoint_every": 100,
    }, PAPER_DEPTHS, [0, 1]),
    # The paper's 36 runs: 20 k steps of 64 x 256 tokens each, bf16, one GPU per run.
    "paper": ("paper", {}, PAPER_DEPTHS, [0, 1, 2, 3]),
}


_DEMO_BASE: dict[str, Any] = E1_PRESETS["demo"][1]

E3_MODES = ["none", "hold", "shrink"]
# preset -> (training preset, overrides for every run, seeds)
E3_PRESETS: dict[str, tuple[str, dict[str, Any], list[int]]] = {
    "smoke": ("smoke", {}, [0, 1]),
    # 15 runs of the E1 demo's depth-4 model. Probes (every 25 steps) and evals (every 75)
    # are denser than E1's so the early phase (first 75 steps) has three probes and one
    # validation loss.
    "demo": ("demo", deep_merge(_DEMO_BASE, {"model": {"n_layer": 4, "qk_init": "normal"},
                                             "probe_every": 25, "eval_every": 75}),
             [0, 1, 2, 3, 4]),
    "paper": ("paper", {"model": {"n_layer": 6, "qk_init": "normal"}}, [0, 1, 2, 3, 4]),
}


def _base(name: str, base: dict[str, Any], data: str,
          overrides: dict[str, Any] | None) -> dict[str, Any]:
    merged = deep_merge(nest_keys(base, f"{name} base"),
                        nest_keys(overrides or {}, f"{name} overrides"))
    if data:
        merged["data"] = str(data)
    return merged


def _need_data(experiment: str, preset: str, data: str) -> None:
    if preset == "paper" and not data:
        raise QKGeomError(f"the paper {experiment} grid trains on WikiText-103: pass data=<folder "
                          "prepared with `qkgeom data prepare --source wikitext-103`>")


def e1_grid(preset: str, data: str = "", overrides: dict[str, Any] | None = None) -> Grid:
    """The E1 grid at size ``preset`` (smoke | demo | paper) on the prepared corpus ``data``.

    ``data=""`` is the embedded Wikipedia sample (the paper preset needs a real corpus).
    ``overrides`` (nested or dotted keys) are applied to every run, e.g.
    ``{"device": "cuda"}``; they are part of the grid, so the sweep folder records them.
    """
    if preset not in E1_PRESETS:
        raise QKGeomError(f"unknown E1 preset {preset!r}; choose one of {', '.join(E1_PRESETS)}")
    train_preset, base, depths, seeds = E1_PRESETS[preset]
    _need_data("E1", preset, data)
    return Grid.from_dict({
        "name": f"e1-{preset}",
        "preset": train_preset,
        "base": _base("e1", base, data, overrides),
        "axes": {"model.n_layer": list(depths), "model.qk_init": list(QK_INITS),
                 "seed": list(seeds)},
    })


def e3_grid(preset: str, data: str = "", overrides: dict[str, Any] | None = None) -> Grid:
    """The E3 grid at size ``preset``: seeds x ``key_control.mode`` ∈ {none, hold, shrink}.

    The seed is the outer axis, so a sweep finishes whole pairs first and a partial sweep
    already has complete (none, hold, shrink) triples to compare. ``overrides`` as in
    :func:`e1_grid` (e.g. ``{"key_control": {"shrink_to": 0.3, "scope": "head"}}``).
    """
    if preset not in E3_PRESETS:
        raise QKGeomError(f"unknown E3 preset {preset!r}; choose one of {', '.join(E3_PRESETS)}")
    train_preset, base, seeds = E3_PRESETS[preset]
    _need_data("E3", preset, data)
    return Grid.from_dict({
        "name": f"e3-{preset}",
        "preset": train_preset,
        "base": _base("e3", base, data, overrides),
        "axes": {"seed": list(seeds), "key_control.mode": list(E3_MODES)},
    })


GRIDS: dict[str, Callable[..., Grid]] = {"e1": e1_grid, "e3": e3_grid}


def reproduce(
    experiment: str,
    preset: str,
    out_dir: str | Path,
    data: str = "",
    *,
    workers: int | None = None,
    backend: str = "local",
    address: str | None = None,
    threads_per_run: int | None = None,
    progress: bool = True,
    retry_failed: bool = False,
    overrides: dict[str, Any] | None = None,
    retries: int = 0,
) -> SweepSummary:
    """Expand the grid of ``experiment`` (``e1`` | ``e3``) at size ``preset`` and run it into
    ``out_dir`` (resumable; see :func:`~qkgeom.experiments.runner.run_sweep`).

    ``workers=None`` picks the layout measured fastest for each size: for ``smoke`` and
    ``demo`` (small CPU models that do not scale across threads) one single-threaded run
    per CPU, at most one per run (benchmarks/sweep_scaling.py: 2 workers x 1 thread was
    3.5x faster than 1 worker x 2 threads on 2 shared cores); for ``paper`` one run at a
    time (one GPU). ``overrides`` (nested or dotted config keys) apply to every run.
    ``retries``: Ray task retries (see :func:`~qkgeom.experiments.runner.run_sweep`).
    """
    if experiment not in GRIDS:
        raise QKGeomError(f"unknown experiment {experiment!r}; choose one of "
                          f"{', '.join(GRIDS)}")
    grid = GRIDS[experiment](preset, data, overrides)
    if workers is None:
        workers = 1 if preset == "paper" else max(1, min(available_cpus(), len(grid.expand())))
        if preset != "paper" and threads_per_run is None:
            threads_per_run = 1
    return run_sweep(grid, out_dir, workers=workers, backend=backend, address=address,
                     threads_per_run=threads_per_run, progress=progress,
                     retry_failed=retry_failed, retries=retries)


def reproduce_e1(preset: str, out_dir: str | Path, data: str = "", **options: Any) -> SweepSummary:
    """E1 + E2: :func:`reproduce` of the E1 grid (depth x Q/K init x seed)."""
    return reproduce("e1", preset, out_dir, data, **options)


def reproduce_e3(preset: str, out_dir: str | Path, data: str = "", **options: Any) -> SweepSummary:
    """E3: :func:`reproduce` of the E3 grid (seed x key-control mode, paired by seed)."""
    return reproduce("e3", preset, out_dir, data, **options)
