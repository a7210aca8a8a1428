"""Grid throughput with several runs side by side on one device (runs per GPU, or on a CPU
runs x threads per run).

Each layout is measured by :func:`qkgeom.experiments.packing.measure_packing`, the probe
``qkgeom sweep run --runs-per-gpu auto`` uses: that many fresh processes train the same
config at once, wait at a barrier until all are warm, then time ``--steps`` steps; the
summed tokens/s counts only the window in which all of them were timing. Printed per
layout: summed and per-run tokens/s, paper-length runs finished per hour (327.7 M tokens
each), memory per run (CUDA: reserved peak + a context; CPU: peak RSS) and the speed-up
over one run; then the count the ``auto`` rule picks. Last line: best summed tokens/s /
one run's.

On a CUDA machine (``--device cuda``, what gpu_check.sh runs): the paper preset's model
(6 x 384, context 256, batch 64, bf16 as the preset says; ``--compile`` to add
torch.compile) on the embedded sample, at 1, 2, 4, 8 runs per GPU (a count whose projected
memory would not fit is skipped). On a CPU (``--device cpu``, the default): the E1 demo run
(depth 4, batch 16 x 64) at the layouts ``--layouts`` (runs x threads per run).

    python benchmarks/grid_packing.py [--device cpu|cuda] [--counts 1,2,4,8]
        [--layouts 1x2,2x1] [--steps 60] [--warmup 15] [--depth 6] [--compile]
"""

from __future__ import annotations

import argparse
import sys

from qkgeom.config import make_config, with_vocab
from qkgeom.data import ensure_sample_data, load_prepared
from qkgeom.experiments import experiment
from qkgeom.experiments.packing import (
    PackingResult,
    choose_runs_per_gpu,
    describe,
    fits,
    measure_packing,
)

PAPER_RUN_TOKENS = 20_000 * 64 * 256  # one paper-preset run


def config(device: str, depth: int, compile_: bool) -> dict:
    data = ensure_sample_data()
    vocab = load_prepared(data).vocab.vocab_size
    if device.startswith("cuda"):
        cfg = make_config("paper", {"data": str(data), "device": device, "compile": compile_,
                                    "model": {"n_layer": depth}})
        return with_vocab(cfg, vocab).to_dict()
    spec = experiment("e1").grid("demo", "", {"compile": compile_}).expand()[0]  # depth 4, normal, seed 0
    return with_vocab(spec.config, vocab).to_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--counts", default="1,2,4,8", help="CUDA: runs per GPU")
    ap.add_argument("--layouts", default="1x2,2x1", help="CPU: RUNSxTHREADS per layout")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    cfg = config(args.device, args.depth, args.compile)
    layouts = ([(int(k), 1) for k in args.counts.split(",")] if cuda else
               [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")])
    m = cfg["model"]
    print(f"{args.device}: {m['n_layer']} x {m['n_embd']}, context {m['block_size']}, batch "
          f"{cfg['batch_size']}, precision {cfg['precision']}, compile {cfg['compile']}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per process", flush=True)
    results: list[PackingResult] = []
    total = None
    for runs, threads in layouts:
        if cuda and results and not fits(runs, results[0].memory, total):
            print(f"{runs} run(s) at once: skipped (projected memory does not fit)", flush=True)
            continue
        r = measure_packing(cfg, runs, threads=threads, warmup=args.warmup, steps=args.steps)
        total = total or r.device_memory
        results.append(r)
        print(describe(r), flush=True)
    ok = [r for r in results if r.ok]
    if not ok:
        sys.exit("no layout could be measured")
    base = next((r for r in ok if r.runs == 1), ok[0])
    print(f"{'runs':>5}{'threads':>8}{'tokens/s summed':>17}{'per run':>10}"
          f"{'paper runs/h':>13}{'GiB/run':>9}{'vs first':>10}")
    for r in ok:
        print(f"{r.runs:>5}{r.threads:>8}{r.tokens_per_s:>17,.0f}{r.per_run:>10,.0f}"
              f"{r.runs_per_hour(PAPER_RUN_TOKENS):>13.2f}{r.memory / 2**30:>9.2f}"
              f"{r.tokens_per_s / base.tokens_per_s:>10.2f}")
    if cuda:
        print(f"--runs-per-gpu auto would pick {choose_runs_per_gpu(results, total)} "
              f"(device memory {total / 2**30 if total else float('nan'):.0f} GiB)")
    best = max(ok, key=lambda r: r.tokens_per_s)
    print(f"best layout {best.runs} x {best.threads}: {best.tokens_per_s / base.tokens_per_s:.2f}"
          f"x the summed tokens/s of {base.runs} x {base.threads}")
    print(f"{best.tokens_per_s / base.tokens_per_s:.3f}")


if __name__ == "__main__":
    main()
