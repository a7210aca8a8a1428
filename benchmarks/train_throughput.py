"""Training tokens/s of ``qkgeom.train()`` vs a plain PyTorch loop of the same model.

The claim it checks (issue 6): qkgeom's trainer, records included, is at least as fast as a
plain nanoGPT-style loop of the same model in fp32 (ratio >= 1.0) at both sizes, and with
bf16 (+ compile) on a CPU with bf16 matmul units at least 2x the fp32 plain loop at the
paper size. Both train the same GPT class on the embedded sample in this process,
interleaved per rep (plain, then every qkgeom variant); the first steps of each are not
timed (see ``_common.py``). qkgeom's tokens/s is its hot loop (batch sampling from the
memmap, autocast, compiled step, loss bookkeeping, callbacks) plus one probe + eval +
checkpoint per probe interval of the preset (small 100 steps, paper 500), measured at the
end of the run; ``hot`` is the loop alone.

Sizes: ``small`` 4 x 128, context 64, batch 32; ``paper`` 6 x 384, context 256, batch 8 on
CPU (the preset's 64 on a GPU). Variants: ``fp32``, ``fp32+compile``, ``bf16``,
``bf16+compile``. Last line: the headline ratios.

    python benchmarks/train_throughput.py [--quick] [--sizes small paper] [--threads 1 2]
        [--reps 2] [--variants fp32 fp32+compile bf16 bf16+compile]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _common import SIZES, plain_loop, sample_config, summary, timed_train

from qkgeom.data import load_prepared

STEPS = {"small": 40, "paper": 12}
QUICK_STEPS = {"small": 20, "paper": 6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["small", "paper"], choices=list(SIZES))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--variants", nargs="+",
                    default=["fp32", "fp32+compile", "bf16", "bf16+compile"])
    ap.add_argument("--quick", action="store_true", help="1 rep, fewer steps, 1 thread")
    args = ap.parse_args()
    steps = QUICK_STEPS if args.quick else STEPS
    if args.quick:
        args.reps, args.threads = 1, [1]
    print(f"torch {torch.__version__}; timed steps after 3 warm-up steps: "
          + ", ".join(f"{s} {steps[s] - 3}" for s in args.sizes), flush=True)
    head: dict[str, float] = {}
    for size in args.sizes:
        for threads in args.threads:
            torch.set_num_threads(threads)
            cfgs = {}
            for v in args.variants:
                precision, _, comp = v.partition("+")
                cfgs[v] = sample_config(size, steps[size], threads=threads,
                                        precision=precision, compile=comp == "compile")
            train_tokens = load_prepared(cfgs[args.variants[0]].data).train
            plain: list[float] = []
            ours: dict[str, list[float]] = {v: [] for v in args.variants}
            hot: dict[str, list[float]] = {v: [] for v in args.variants}
            for rep in range(args.reps):
                plain.append(plain_loop(cfgs[args.variants[0]], train_tokens, steps[size]))
                line = [f"plain {plain[-1]:,.0f}"]
                for v, cfg in cfgs.items():
                    t = timed_train(cfg, SIZES[size]["cadence"])
                    ours[v].append(t.tokens_per_s)
                    hot[v].append(t.hot_tokens_per_s)
                    line.append(f"{v} {t.tokens_per_s:,.0f}")
                print(f"  {size} {threads}t rep {rep + 1}: " + ", ".join(line), flush=True)
            p = statistics.median(plain)
            cfg = cfgs[args.variants[0]]
            print(f"{size}: {cfg.model.n_layer} x {cfg.model.n_embd}, ctx {cfg.model.block_size},"
                  f" batch {cfg.batch_size}; {threads} thread(s); tokens/s median (range)")
            print(f"  {'loop':<22}{'tokens/s':>26}{'hot loop':>26}{'vs plain':>10}")
            print(f"  {'plain fp32':<22}{summary(plain):>26}{'':>26}{1.0:>10.3f}")
            for v in args.variants:
                r = statistics.median(ours[v]) / p
                print(f"  {'qkgeom ' + v:<22}{summary(ours[v]):>26}{summary(hot[v]):>26}"
                      f"{r:>10.3f}")
                head[f"{size}/{threads}t/{v}"] = r
    best_fp32 = {k: v for k, v in head.items() if "/fp32" in k}
    print("ratio qkgeom/plain-fp32 tokens/s (records included): "
          + "; ".join(f"{k} {v:.2f}" for k, v in head.items())
          + (f"; best fp32 {max(best_fp32.values()):.2f}" if best_fp32 else ""))


if __name__ == "__main__":
    main()
