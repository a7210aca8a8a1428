"""GPU check: the paper preset for a fixed number of steps with bf16 + torch.compile.

Prints the steady-state training tokens/s (hot loop: steps after the compile warm-up), the
MFU against the GPU's dense bf16 peak, the same for a plain eager fp32 loop of the same
model (for scale), and the probe overhead at the preset's cadence. The peak is looked up by
device name (H100/H200 989 TFLOP/s, A100 312, L4 121, ...) or given as
``QKGEOM_PEAK_TFLOPS``. Trains on the embedded Wikipedia sample (nothing to download); the
model, batch and sequence length are the paper preset's (6 x 384, 64 x 256). Last line: MFU.

    python benchmarks/gpu_check.py [--steps 300] [--depth 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from _common import matmul_peak, plain_loop, timed_train

from qkgeom import GPT, make_config, measure
from qkgeom.config import with_vocab
from qkgeom.data import ensure_sample_data, load_prepared, probe_set
from qkgeom.model import flops_per_token

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by a substring of the device name.
BF16_PEAKS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "A100": 312.0, "A10G": 125.0,
              "L40S": 362.0, "L4": 121.0, "RTX 4090": 165.0, "RTX 3090": 71.0, "V100": 125.0}


def peak_tflops(name: str) -> float | None:
    if os.environ.get("QKGEOM_PEAK_TFLOPS"):
        return float(os.environ["QKGEOM_PEAK_TFLOPS"])
    for key in sorted(BF16_PEAKS, key=len, reverse=True):
        if key in name:
            return BF16_PEAKS[key]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--depth", type=int, default=6)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible to torch")
    name = torch.cuda.get_device_name()
    print(f"device {name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"bf16 supported: {torch.cuda.is_bf16_supported()}", flush=True)
    data_dir = ensure_sample_data()
    data = load_prepared(data_dir)
    cfg = make_config("paper", {
        "data": str(data_dir), "device": "cuda", "compile": True, "precision": "auto",
        "model": {"n_layer": args.depth}, "steps": args.steps, "warmup_steps": 50,
        "probe_every": args.steps, "eval_every": args.steps, "checkpoint_every": args.steps,
        "log_every": 50})
    cfg = with_vocab(cfg, data.vocab.vocab_size)
    fpt = flops_per_token(cfg.model)
    tokens_per_step = cfg.batch_size * cfg.model.block_size
    print(f"paper preset: {cfg.model.n_layer} x {cfg.model.n_embd}, ctx {cfg.model.block_size}, "
          f"batch {cfg.batch_size} ({tokens_per_step:,} tokens/step), precision "
          f"{cfg.effective_precision}, compile on; {fpt / 1e6:.1f} MFLOP/token", flush=True)

    t0 = time.perf_counter()
    timed = timed_train(cfg, cadence=500)
    print(f"qkgeom train, {args.steps} steps in {time.perf_counter() - t0:.0f} s "
          f"(compile included)", flush=True)
    tps = timed.hot_tokens_per_s
    measured_peak = matmul_peak(torch.bfloat16, n=8192, device="cuda")
    table_peak = peak_tflops(name)
    peak = table_peak * 1e12 if table_peak else measured_peak
    print(f"hot loop: {tps:,.0f} tokens/s = {tps * fpt / 1e12:.1f} TFLOP/s; "
          f"bf16 peak {peak / 1e12:.0f} TFLOP/s ({'table' if table_peak else 'measured'}; "
          f"measured 8192^2 bf16 matmul {measured_peak / 1e12:.0f} TFLOP/s)")
    print(f"with records at the preset cadence (probe+eval+ckpt {timed.records_s:.2f} s per "
          f"500 steps): {timed.tokens_per_s:,.0f} tokens/s")

    plain = plain_loop(cfg, data.train, 60, device="cuda")
    print(f"plain eager fp32 loop, same model: {plain:,.0f} tokens/s; qkgeom bf16+compile / "
          f"plain = {tps / plain:.2f}x")

    model = GPT(cfg.model).cuda()
    ptoks = probe_set(data.val, cfg.probe_sequences, cfg.model.block_size)
    measure(model, ptoks, batch_size=cfg.probe_batch)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        measure(model, ptoks, batch_size=cfg.probe_batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t1)
    step_s = tokens_per_step / tps
    p = statistics.median(times)
    print(f"probe: {1e3 * p:.0f} ms = {p / step_s:.1f} training steps; every "
          f"{cfg.probe_every if cfg.probe_every != args.steps else 500} steps: "
          f"{100 * p / (500 * step_s):.2f}% overhead")
    est_h = 20000 * step_s / 3600
    print(f"paper preset run (20k steps) at this speed: {est_h:.2f} h; E1 (36 runs) "
          f"{36 * est_h:.1f} GPU-h, E3 (15 runs) {15 * est_h:.1f} GPU-h")
    print(f"MFU (bf16 + compile, paper preset) vs {peak / 1e12:.0f} TFLOP/s: "
          f"{100 * tps * fpt / peak:.1f}%")


if __name__ == "__main__":
    main()
