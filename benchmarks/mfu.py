"""Model FLOPs utilisation of qkgeom's training loop against the measured matmul peak.

The claim it checks: the training step keeps the machine's matmul units busy; MFU =
(training FLOPs per token x hot-loop tokens/s) / the peak matmul FLOP/s that torch reaches
here *at the precision in use* (fp32 peak for fp32 runs, bf16 peak for bf16 runs), measured
in this process with the same thread count (1024^2 square matmuls, best of 3). FLOPs per
token: :func:`qkgeom.model.flops_per_token` (6 x matmul params + 12 L T d). Peaks and runs
are interleaved per rep. Last line: the MFU of each variant at each size.

    python benchmarks/mfu.py [--quick] [--sizes small paper] [--threads 1]
        [--variants fp32 bf16+compile] [--reps 2]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _common import SIZES, matmul_peak, sample_config, summary, timed_train

from qkgeom.model import flops_per_token

STEPS = {"small": 40, "paper": 12}
QUICK_STEPS = {"small": 20, "paper": 6}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["small", "paper"], choices=list(SIZES))
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--variants", nargs="+", default=["fp32", "bf16", "bf16+compile"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 rep, fewer steps")
    args = ap.parse_args()
    steps = QUICK_STEPS if args.quick else STEPS
    if args.quick:
        args.reps = 1
    out: dict[str, float] = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        peaks: dict[str, list[float]] = {p: [] for p in DTYPES}
        for size in args.sizes:
            cfgs = {v: sample_config(size, steps[size], threads=threads,
                                     precision=v.partition("+")[0],
                                     compile=v.endswith("+compile")) for v in args.variants}
            fpt = flops_per_token(cfgs[args.variants[0]].model)
            tps: dict[str, list[float]] = {v: [] for v in args.variants}
            for _ in range(args.reps):
                for p, dtype in DTYPES.items():
                    peaks[p].append(matmul_peak(dtype))
                for v, cfg in cfgs.items():
                    tps[v].append(timed_train(cfg, SIZES[size]["cadence"]).hot_tokens_per_s)
            print(f"{size} ({fpt / 1e6:.1f} MFLOP/token), {threads} thread(s):")
            for v in args.variants:
                peak = statistics.median(peaks[v.partition("+")[0]])
                achieved = [fpt * t for t in tps[v]]
                mfu = statistics.median(achieved) / peak
                print(f"  {v:<14} {summary(tps[v])} tok/s = "
                      f"{summary([a / 1e9 for a in achieved], '.1f')} GFLOP/s; "
                      f"{v.partition('+')[0]} peak {peak / 1e9:.0f} GFLOP/s; MFU {100 * mfu:.1f}%",
                      flush=True)
                out[f"{size}/{threads}t/{v}"] = mfu
        print(f"measured matmul peaks, {threads} thread(s): " + ", ".join(
            f"{p} {summary([x / 1e9 for x in v])} GFLOP/s" for p, v in peaks.items()))
    print("MFU vs the measured matmul peak of the precision in use: "
          + "; ".join(f"{k} {100 * v:.1f}%" for k, v in out.items()))


if __name__ == "__main__":
    main()
