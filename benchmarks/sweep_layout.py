"""One grid, two local layouts: a fresh process per run (before) vs persistent workers.

The grid is the first ``--runs`` runs of the E1 grid at ``--preset`` (demo: depth 4, 16 x
64 tokens per step, probes every 40 steps) with ``--steps`` steps each, so both layouts
train exactly the same runs; the only difference is ``max_runs_per_worker`` (1: a new
``python -m qkgeom.experiments worker`` process per run, paying the torch import and the
first-optimiser imports each time; None: each worker trains run after run). Both use
``--workers`` workers x ``--threads`` threads. Layouts alternate within each rep (the
order flips every rep) so machine noise hits them alike. Each wall time is the whole
``run_sweep`` call (data check, workers' start, training, records).

Last line: wall(fresh process per run) / wall(persistent workers), medians.

    python benchmarks/sweep_layout.py [--preset demo] [--runs 6] [--steps 100] [--reps 1]
        [--workers 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from qkgeom.data import ensure_sample_data
from qkgeom.experiments import Grid, experiment

LAYOUTS = {"fresh process per run": 1, "persistent workers": None}


def grid(preset: str, runs: int, steps: int) -> Grid:
    """The first ``runs`` runs of the E1 grid (seed is the last axis, so seeds vary first)."""
    full = experiment("e1").grid(preset, "", {"steps": steps, "checkpoint_every": steps})
    data = full.to_dict()
    axes = data["axes"]
    depth = axes["model.n_layer"][:1]
    per_depth = len(axes["model.qk_init"]) * len(axes["seed"])
    if runs > per_depth:
        raise SystemExit(f"--runs at most {per_depth} (one depth)")
    inits = axes["model.qk_init"][: -(-runs // len(axes["seed"]))]
    data["axes"] = {"model.n_layer": depth, "model.qk_init": inits, "seed": axes["seed"]}
    data["name"] = f"layout-{preset}"
    return Grid.from_dict(data)


def main() -> None:
    from qkgeom.experiments import run_sweep

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="demo", choices=("smoke", "demo"))
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    ensure_sample_data()  # prepared once, outside the timings
    g = grid(args.preset, args.runs, args.steps)
    specs = g.expand()
    tokens = sum(s.config.steps * s.config.batch_size * s.config.model.block_size
                 for s in specs)
    print(f"grid: {len(specs)} runs of E1 {args.preset} (depth {specs[0].config.model.n_layer})"
          f" x {args.steps} steps = {tokens:,} training tokens; {args.workers} worker(s) x "
          f"{args.threads} thread(s)", flush=True)
    walls: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = list(LAYOUTS) if rep % 2 == 0 else list(reversed(LAYOUTS))
            for name in order:
                out = Path(tmp) / f"{LAYOUTS[name]}-{rep}"
                t0 = time.perf_counter()
                summary = run_sweep(g, out, workers=args.workers, threads_per_run=args.threads,
                                    progress=False, max_runs_per_worker=LAYOUTS[name])
                wall = time.perf_counter() - t0
                assert summary.complete, summary
                walls[name].append(wall)
                print(f"rep {rep + 1}: {name}: {wall:.1f} s", flush=True)
    print(f"{'layout':<24}{'wall s (median)':>17}{'tokens / wall-s':>17}")
    for name, values in walls.items():
        med = statistics.median(values)
        print(f"{name:<24}{med:>17.1f}{tokens / med:>17,.0f}")
    old, new = (statistics.median(walls[n]) for n in LAYOUTS)
    print(f"ratio wall(fresh process per run) / wall(persistent workers): {old / new:.2f}")


if __name__ == "__main__":
    main()
