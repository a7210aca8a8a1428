"""A checkpoint family analysed in one process with all threads vs spread over workers.

The family: the checkpoints of one short run of the small preset's model (4 x 128, context 64),
trained here for ``--checkpoints`` steps with a checkpoint after each, analysed on the
embedded sample text (``--tokens`` tokens per checkpoint, windows of 64, one block).
Layouts, interleaved within each rep (order flipped every rep): one process with
``--threads`` threads (the default ``qkgeom analyze``), and ``--threads`` worker processes
with 1 thread each (``qkgeom analyze --workers N --threads 1``); both write the same tables
(tests/checkpoints/test_executors.py). Wall time includes the workers' start.

Last line: wall(one process x N threads) / wall(N workers x 1 thread), medians.

    python benchmarks/analysis_layout.py [--checkpoints 4] [--tokens 65536] [--threads 2]
        [--reps 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from qkgeom import make_config, train
from qkgeom.checkpoints.family import analyze_checkpoints
from qkgeom.data import ensure_sample_data
from qkgeom.experiments.executors import make_executor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    data = ensure_sample_data()
    n = args.checkpoints
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config("small", {"data": str(data), "steps": n, "checkpoint_every": 1,
                                   "keep_checkpoints": 0, "probe_every": n, "eval_every": n,
                                   "warmup_steps": 1, "threads": 1})
        run = train(cfg, Path(tmp) / "run").out_dir
        kw = {"text": "sample", "max_tokens": args.tokens, "seq_len": 64, "blocks": 1}
        layouts = {f"1 process x {args.threads} threads": None,
                   f"{args.threads} workers x 1 thread": make_executor("local",
                                                                      workers=args.threads)}
        walls: dict[str, list[float]] = {name: [] for name in layouts}
        print(f"family: {n} checkpoints of the small model (4 x 128, context 64), "
              f"{args.tokens:,} tokens each", flush=True)
        for rep in range(args.reps):
            order = list(layouts) if rep % 2 == 0 else list(reversed(layouts))
            for name in order:
                torch.set_num_threads(args.threads)
                t0 = time.perf_counter()
                analyze_checkpoints([str(run)], Path(tmp) / f"an-{rep}-{len(walls[name])}"
                                    f"-{name.split()[0]}", executor=layouts[name], **kw)
                walls[name].append(time.perf_counter() - t0)
                print(f"rep {rep + 1}: {name}: {walls[name][-1]:.1f} s", flush=True)
    tokens = n * args.tokens
    print(f"{'layout':<28}{'wall s':>9}{'tokens/s':>11}")
    for name, values in walls.items():
        med = statistics.median(values)
        print(f"{name:<28}{med:>9.1f}{tokens / med:>11,.0f}")
    one, spread = (statistics.median(v) for v in walls.values())
    print(f"ratio wall(1 process x {args.threads} threads) / wall({args.threads} workers x 1 "
          f"thread): {one / spread:.2f}")


if __name__ == "__main__":
    main()
