"""Per-run fixed costs of a sweep's run: what a run pays besides its training steps.

Measured on one run of the E1 demo grid (depth 4, 16 x 64 tokens per step, probes every
40 steps, eval every 100 on 4 batches), shortened to ``--steps`` (default 80) with the
same cadences. A child process is started the way a sweep worker is (``python -m``) and
the parent times how long it takes until torch and the trainer are imported; the child
then trains two runs (two seeds) one after the other, as a persistent worker does, with
each phase of the trainer wrapped in a timer:

- import: interpreter start + ``import qkgeom.launch`` (torch included), once per process;
- setup: data open, size checks, run folder and lock (Trainer construction), model build
  (seeded init), optimiser;
- first step: the first update minus a steady step (allocator, oneDNN/fused-AdamW
  kernel selection, lazy module init);
- probe, eval, checkpoint: each call, and per run at the real demo cadence;
- table writes: RunWriter flush / compact / status (Parquet and JSON, atomic).

The second run shows which costs a reused process no longer pays. Last line: the share of
a fresh-process demo run's wall time that is fixed cost, first run vs second run.

    python benchmarks/run_fixed_costs.py [--steps 80] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ["setup", "model build", "optimizer", "first step", "probe", "eval", "checkpoint",
          "table writes"]
DEMO = {"steps": 400, "probe_every": 40, "eval_every": 100, "checkpoint_every": 400}


def child(steps: int, threads: int) -> None:
    """Import, say so, then train two runs with the trainer's phases timed."""
    t_imp = time.perf_counter()
    import torch

    import qkgeom.launch
    import qkgeom.runs.writer as writer_mod
    import qkgeom.training.trainer as trainer_mod
    from qkgeom.experiments import experiment
    from qkgeom.experiments.runner import resolve_data
    from qkgeom.training import Callback

    print(json.dumps({"imported_in": time.perf_counter() - t_imp}), flush=True)
    torch.set_num_threads(threads)
    spans: list[tuple[str, float, float]] = []

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spans.append((name, t0, time.perf_counter()))
        return wrapper

    trainer_mod.GPT = timed("model build", trainer_mod.GPT)
    trainer_mod.make_optimizer = timed("optimizer", trainer_mod.make_optimizer)
    trainer_mod.measure = timed("probe", trainer_mod.measure)
    trainer_mod.evaluate = timed("eval", trainer_mod.evaluate)
    trainer_mod.save_checkpoint = timed("checkpoint", trainer_mod.save_checkpoint)
    for meth in ("flush", "compact", "status"):
        setattr(writer_mod.RunWriter, meth, timed("table writes",
                                                  getattr(writer_mod.RunWriter, meth)))
    trainer_mod.Trainer.__init__ = timed("setup", trainer_mod.Trainer.__init__)

    class Clock(Callback):
        def __init__(self) -> None:
            self.start = 0.0
            self.ends: list[float] = []

        def on_train_start(self, ctx) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, ctx) -> None:
            self.ends.append(time.perf_counter())

    grid = experiment("e1").grid("demo", "", {"steps": steps, "checkpoint_every": steps,
                                "model": {"n_layer": 4}})
    specs = resolve_data(grid.expand())[:2]
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(specs):
            spans.clear()
            clock = Clock()
            cfg = spec.config
            t0 = time.perf_counter()
            qkgeom.launch.train(cfg, Path(tmp) / f"run{i}", callbacks=[clock])
            wall = time.perf_counter() - t0
            marks = [clock.start, *clock.ends]
            # a step's interval minus the phases inside it (the boundary before the update)
            pure = []
            for a, b in zip(marks, marks[1:], strict=False):
                inside = sum(e - s for _, s, e in spans if s >= a and e <= b)
                pure.append(b - a - inside)
            steady = statistics.median(pure[1:])
            per: dict[str, list[float]] = {}
            for name, s, e in spans:
                per.setdefault(name, []).append(e - s)
            out = {name: per.get(name, []) for name in PHASES}
            out["first step"] = [pure[0] - steady]
            print(json.dumps({"run": i, "wall": wall, "steady_step": steady,
                              "tokens_per_step": cfg.batch_size * cfg.model.block_size,
                              "phases": out}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args.steps, args.threads)
        return
    from qkgeom.data import ensure_sample_data

    ensure_sample_data()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--steps", str(args.steps),
                             "--threads", str(args.threads)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    ready = time.perf_counter() - t0
    runs = [json.loads(line) for line in proc.stdout]
    proc.wait()
    steady = runs[0]["steady_step"]
    print(f"E1 demo run (depth 4, 16 x 64 tokens/step) shortened to {args.steps} steps, "
          f"{args.threads} thread(s); steady step {1e3 * steady:.1f} ms "
          f"({runs[0]['tokens_per_step'] / steady:,.0f} tokens/s)")
    print(f"process start to trainer imported: {ready:.2f} s (imports alone "
          f"{first['imported_in']:.2f} s)")
    counts = {"probe": DEMO["steps"] // DEMO["probe_every"] + 1,
              "eval": DEMO["steps"] // DEMO["eval_every"] + 1, "checkpoint": 1}
    header = (f"{'phase':<14}{'run 1 (fresh) s':>17}{'run 2 (reused) s':>18}"
              f"{'per call (steps)':>18}{'per demo run s':>16}")
    print(header)
    print("-" * len(header))
    rows = [("import", ready, 0.0, None, None)]
    for name in PHASES:
        a, b = (sum(r["phases"][name]) for r in runs)
        calls = runs[1]["phases"][name]
        per_call = statistics.median(calls) if calls else None
        demo = None
        if name in counts and per_call is not None:
            demo = per_call * counts[name]
        rows.append((name, a, b, per_call, demo))
    for name, a, b, per_call, demo in rows:
        pc = f"{per_call:.3f} ({per_call / steady:.1f})" if per_call is not None else "-"
        print(f"{name:<14}{a:>17.3f}{b:>18.3f}{pc:>18}"
              f"{(f'{demo:.2f}' if demo is not None else '-'):>16}")
    hot = DEMO["steps"] * steady
    # a demo run's fixed part: import (fresh only), setup, first step, the cadenced phases
    # and the table writes of the shortened run as a floor
    cadenced = sum(d for *_, d in rows if d is not None)

    def fixed(i: int) -> float:
        r = runs[i]["phases"]
        once = sum(sum(r[n]) for n in ("setup", "first step", "table writes"))
        return (ready if i == 0 else 0.0) + once + cadenced

    for i, label in ((0, "fresh process"), (1, "reused process")):
        print(f"demo run ({DEMO['steps']} steps) in a {label}: {hot:.1f} s of steps + "
              f"{fixed(i):.1f} s fixed = {100 * fixed(i) / (hot + fixed(i)):.1f} % fixed")
    print(f"fixed share, fresh vs reused process: {fixed(0) / (hot + fixed(0)):.3f} "
          f"{fixed(1) / (hot + fixed(1)):.3f}")


if __name__ == "__main__":
    main()
