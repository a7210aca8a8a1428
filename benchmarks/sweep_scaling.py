"""Wall time of one fixed sweep at several workers x threads layouts on this machine.

The claim it checks: on a small CPU machine, running runs side by side (more workers, one
thread each) beats giving each run all the threads, because these small models do not
scale across threads (dispatch overhead, small matmuls) while independent runs do. The grid
is fixed: 4 runs (2 layers x width 64 x context 64, batch 16, 150 steps, probes every 50)
on the embedded sample. Layouts run interleaved (rep 1 of every layout, then rep 2, ...) so
machine noise hits them alike; the medians are compared. Each wall time includes the
worker processes' start (about 3 s of imports per worker). Last line: the ratio.

Besides wall time, the table gives the sweep's throughput (training tokens of all runs /
wall time) and the speed-up over 1 worker x 1 thread; the layout with the highest
throughput is what ``qkgeom sweep`` / ``reproduce`` should pick by default on this machine
(they pick one single-thread worker per CPU).

    python benchmarks/sweep_scaling.py [--quick] [--reps 2] [--steps 150]
        [--layouts 1x2 2x1 1x1 2x2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from qkgeom.data import ensure_sample_data
from qkgeom.experiments import Grid, run_sweep


def grid(steps: int) -> Grid:
    return Grid.from_dict({
        "name": "scaling", "preset": "small",
        "base": {"model": {"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 64},
                 "steps": steps, "batch_size": 16, "warmup_steps": 10, "probe_every": 50,
                 "eval_every": 50, "eval_batches": 4, "checkpoint_every": steps},
        "axes": {"seed": [0, 1, 2, 3]},
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--layouts", nargs="+", default=["1x2", "2x1", "1x1", "2x2"],
                        help="WORKERSxTHREADS; the first two are compared on the last line")
    parser.add_argument("--quick", action="store_true", help="1 rep of 60 steps")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.steps = 1, 60
    ensure_sample_data()  # prepared once, outside the timings
    g = grid(args.steps)
    layouts = [tuple(int(x) for x in layout.split("x")) for layout in args.layouts]
    walls: dict[tuple[int, int], list[float]] = {layout: [] for layout in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for workers, threads in layouts:
                out = Path(tmp) / f"{workers}x{threads}-{rep}"
                t0 = time.perf_counter()
                summary = run_sweep(g, out, workers=workers, threads_per_run=threads,
                                    progress=False)
                wall = time.perf_counter() - t0
                assert summary.counts["done"] == 4, summary
                walls[(workers, threads)].append(wall)
                print(f"rep {rep + 1}: {workers} worker(s) x {threads} thread(s): {wall:6.1f} s",
                      flush=True)
    print(f"grid: 4 runs x {args.steps} steps x 16 x 64 tokens; median wall time of "
          f"{args.reps} rep(s):")
    tokens = 4 * args.steps * 16 * 64
    base = statistics.median(walls.get((1, 1), next(iter(walls.values()))))
    for (workers, threads), values in walls.items():
        med = statistics.median(values)
        print(f"  {workers} worker(s) x {threads} thread(s): {med:6.1f} s "
              f"({min(values):.1f}-{max(values):.1f}); {tokens / med:,.0f} tokens/s; "
              f"{base / med:.2f}x vs 1x1")
    best = min(walls, key=lambda k: statistics.median(walls[k]))
    print(f"fastest layout here: {best[0]} worker(s) x {best[1]} thread(s)")
    (w1, t1), (w2, t2) = layouts[0], layouts[1]
    ratio = statistics.median(walls[layouts[0]]) / statistics.median(walls[layouts[1]])
    print(f"ratio wall({w1} worker x {t1} threads) / wall({w2} workers x {t2} thread): "
          f"{ratio:.2f}")


if __name__ == "__main__":
    main()
