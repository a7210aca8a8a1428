"""Time per training step of the soft-capped attention path against SDPA, and of QK-Clip.

PyTorch's ``scaled_dot_product_attention`` has no soft-cap, so a model with
``model.logit_softcap`` runs an explicit path (scores, c·tanh(s/c), mask, softmax, @ v)
that materialises the T×T scores for autograd (issue 35). QK-Clip records each head's
largest logit in every training forward (beside SDPA: the scores recomputed without
autograd, only the maxima kept) and rescales W_Q / W_K rows after the step. Identical models
(same init, same random tokens, fused AdamW) train side by side:

- ``sdpa``: the plain model (what every run without a cap trains);
- ``softcap``: ``logit_softcap`` 50 (Gemma 2's c);
- ``qk_clip``: ``qk_clip_threshold`` 100 (Megatron's τ) on SDPA: the recording and the
  clip's rescaling (at τ = 100 it seldom acts, so this is the cost of keeping the maxima);
- ``softcap+qk_clip``: both (the maxima then come free with the explicit scores).

"record ms" is the time inside the per-head max recording beside SDPA plus ``qk_clip_``,
timed directly; "record share" divides it by the ``sdpa`` step. Timed blocks run interleaved
(rep 1 of every variant, then rep 2, ...) so machine noise hits them alike; medians are
compared.

    python benchmarks/softcap_cost.py [--sizes ctx64 ctx256] [--reps 3] [--steps 10]
        [--device cpu] [--precision fp32] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from typing import Any

import torch

from qkgeom.config import GPTConfig
from qkgeom.model import GPT

# The small preset's model (4 x 128, 4 heads), batch 32, at its context 64 and at 256.
SIZES = {
    "ctx64": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch=32),
    "ctx256": dict(n_layer=4, n_head=4, n_embd=128, block_size=256, batch=32),
}
VARIANTS: dict[str, dict[str, Any]] = {
    "sdpa": {}, "softcap": {"logit_softcap": 50.0}, "qk_clip": {"qk_clip_threshold": 100.0},
    "softcap+qk_clip": {"logit_softcap": 50.0, "qk_clip_threshold": 100.0}}
VOCAB = 200


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """One model + optimiser that trains on its own copy of the token stream."""

    def __init__(self, size: dict, variant: str, device: torch.device, precision: str) -> None:
        cfg = GPTConfig(n_layer=size["n_layer"], n_head=size["n_head"], n_embd=size["n_embd"],
                        block_size=size["block_size"], vocab_size=VOCAB)
        cfg = dataclasses.replace(cfg, **VARIANTS[variant])
        self.model = GPT(cfg, generator=torch.Generator().manual_seed(0)).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3,
                                     fused=device.type in ("cpu", "cuda"))
        self.device, self.record_s = device, 0.0
        self.clip = cfg.qk_clip
        for block in self.model.blocks:  # the recording beside SDPA, with a stopwatch
            block.attn._head_max = self._timed(block.attn._head_max)
        self.gen = torch.Generator().manual_seed(1)
        self.batch, self.block = size["batch"], size["block_size"]
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                         if precision == "bf16" else contextlib.nullcontext())

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any) -> Any:
            sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args)
            sync(self.device)
            self.record_s += time.perf_counter() - t0
            return out
        return timed

    def steps(self, n: int) -> tuple[float, float]:
        """Wall seconds for n steps, and the part of it spent recording maxima and clipping."""
        self.record_s = 0.0
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(n):
            x = torch.randint(0, VOCAB, (self.batch, self.block), generator=self.gen)
            x = x.to(self.device)
            with self.autocast:
                _, loss = self.model(x, x)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            if self.clip:
                self._timed(self.model.qk_clip_)()
        sync(self.device)
        return time.perf_counter() - t0, self.record_s


def bench(name: str, steps: int, reps: int, device: torch.device,
          precision: str) -> dict[str, float]:
    size = SIZES[name]
    runners = {v: Runner(size, v, device, precision) for v in VARIANTS}
    for r in runners.values():
        r.steps(1)  # warm-up (allocator, kernels), not timed
    per_step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rec_step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(reps):
        for v in VARIANTS:
            wall, rec = runners[v].steps(steps)
            per_step[v].append(wall / steps)
            rec_step[v].append(rec / steps)
        print(f"  {name} rep {rep + 1}: " + ", ".join(
            f"{v} {1e3 * per_step[v][-1]:.1f} ms" for v in VARIANTS), flush=True)
    base = statistics.median(per_step["sdpa"])
    print(f"{name}: {size['n_layer']} layers x {size['n_embd']}, {size['n_head']} heads, batch "
          f"{size['batch']} x {size['block_size']}, {steps} steps x {reps} reps, "
          f"{device.type} {precision}, {torch.get_num_threads()} threads")
    print(f"  {'variant':<18}{'ms/step':>10}{'range':>18}{'vs sdpa':>10}{'record ms':>11}"
          f"{'record share':>14}")
    ratios = {}
    for v in VARIANTS:
        med, rec = statistics.median(per_step[v]), statistics.median(rec_step[v])
        ratios[v] = med / base
        span = f"{1e3 * min(per_step[v]):.1f}-{1e3 * max(per_step[v]):.1f}"
        print(f"  {v:<18}{1e3 * med:>10.1f}{span:>18}{ratios[v]:>9.2f}x{1e3 * rec:>11.2f}"
              f"{100 * rec / base:>13.1f}%")
    ratios["record_share"] = statistics.median(rec_step["qk_clip"]) / base
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=1, help="0 = torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}")
    results = {name: bench(name, args.steps, args.reps, device, args.precision)
               for name in args.sizes}
    print("step time against SDPA (medians): " + "; ".join(
        f"{n} softcap {r['softcap']:.2f}x, qk_clip {r['qk_clip']:.2f}x (recording "
        f"{100 * r['record_share']:.1f}% of a step), softcap+qk_clip {r['softcap+qk_clip']:.2f}x"
        for n, r in results.items()))


if __name__ == "__main__":
    main()
