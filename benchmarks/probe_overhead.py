"""Probe overhead per training step: one probe's wall time against one training step's.

The claim it checks: measuring the geometry (the trainer's probes: the fixed probe set
through the eager fp32 model with q/k taps, float64 streamed covariances, Gram-trace
interaction spectra, attention entropy) costs a small share of training at the preset's
probe cadence. Timed here: ``qkgeom.measure`` on the preset's probe set (16 sequences x context) and a training
step of the same model (fp32, plain eager step, the benchmark sizes' batch), interleaved per
rep. Share per step = probe time / (probe_every x step time). The key-spectrum control's
overhead is ``control_overhead.py``. Last line: the share at each size.

    python benchmarks/probe_overhead.py [--quick] [--sizes small paper] [--reps 3]
        [--threads 1] [--precision fp32]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from _common import SIZES, sample_config, summary

from qkgeom import GPT
from qkgeom import measure as measure_geometry
from qkgeom.data import load_prepared, probe_set, sample_batch

STEPS = {"small": 10, "paper": 3}


def measure(size: str, reps: int, threads: int, precision: str,
            dev: torch.device) -> tuple[list[float], list[float], tuple[int, int], int]:
    """(step seconds, probe seconds) per rep, the probe set's shape, the batch size."""
    cfg = sample_config(size, 10, threads=threads, device=dev.type)
    data = load_prepared(cfg.data)
    model = GPT(cfg.model, generator=torch.Generator().manual_seed(0)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    tokens = probe_set(data.val, cfg.probe_sequences, cfg.model.block_size)
    gen = torch.Generator().manual_seed(0)
    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step() -> None:
        x, y = sample_batch(data.train, cfg.batch_size, cfg.model.block_size, gen, device=dev)
        with autocast:
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    measure_geometry(model, tokens, batch_size=cfg.probe_batch)  # warm-up, untimed
    step_s, probe_s = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(STEPS[size]):
            step()
        sync()
        step_s.append((time.perf_counter() - t0) / STEPS[size])
        t0 = time.perf_counter()
        measure_geometry(model, tokens, batch_size=cfg.probe_batch)
        sync()
        probe_s.append(time.perf_counter() - t0)
    return step_s, probe_s, tuple(tokens.shape), cfg.batch_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["small", "paper"], choices=list(SIZES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="2 reps")
    args = ap.parse_args()
    if args.quick:
        args.reps = 2
    torch.set_num_threads(args.threads)
    shares = {}
    for size in args.sizes:
        step_s, probe_s, shape, batch = measure(size, args.reps, args.threads, args.precision,
                                                torch.device(args.device))
        cadence = SIZES[size]["cadence"]
        share = statistics.median(probe_s) / (cadence * statistics.median(step_s))
        shares[size] = share
        print(f"{size}: probe set {shape}, train batch {batch}; "
              f"step {summary([1e3 * s for s in step_s], '.0f')} ms, probe "
              f"{summary([1e3 * s for s in probe_s], '.0f')} ms "
              f"(= {statistics.median(probe_s) / statistics.median(step_s):.1f} steps); "
              f"probe_every {cadence}: {100 * share:.2f}% per step", flush=True)
    print("probe overhead per training step at the preset cadence: "
          + "; ".join(f"{k} {100 * v:.2f}%" for k, v in shares.items()))


if __name__ == "__main__":
    main()
