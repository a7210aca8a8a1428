"""Time per training step with and without the key-spectrum control (E3).

The claim it checks: projecting W_K after every optimiser step (float64 SVD of each
layer's W_K or of each head's slice, the bisection for γ, the in-place write and the
re-measured PR) costs a small share of a training step. Three identical models (same
init, same random tokens, fused AdamW as in the trainer) train side by side: no control,
``hold`` at layer scope, ``hold`` at head scope. Timed blocks run interleaved (rep 1 of
every variant, then rep 2, ...) so machine noise hits them alike; medians are compared.
The time spent inside ``KeySpectrumControl.step`` is also measured directly.

Sizes: ``demo`` (4 layers x 128, 4 heads, batch 32 x 64 tokens) and ``paper`` (6 x 384,
6 heads, batch 64 x 256; slow on CPU, so fewer steps). Last line: the overhead share.

    python benchmarks/control_overhead.py [--sizes demo paper] [--reps 3]
        [--demo-steps 20] [--paper-steps 2] [--device cpu] [--precision fp32]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from qkgeom.config import GPTConfig
from qkgeom.control import KeySpectrumControl
from qkgeom.model import GPT

SIZES = {
    "demo": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch=32),
    "paper": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch=64),
}
VARIANTS = ("none", "layer", "head")  # no control; hold at layer scope; hold at head scope
VOCAB = 200


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """One model + optimiser (+ control) that trains on its own copy of the token stream."""

    def __init__(self, size: dict, variant: str, device: torch.device, precision: str) -> None:
        cfg = GPTConfig(n_layer=size["n_layer"], n_head=size["n_head"], n_embd=size["n_embd"],
                        block_size=size["block_size"], vocab_size=VOCAB)
        self.model = GPT(cfg, generator=torch.Generator().manual_seed(0)).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3,
                                     fused=device.type in ("cpu", "cuda"))
        self.ctl = (None if variant == "none" else
                    KeySpectrumControl.attach(self.model, "hold", scope=variant))
        self.gen = torch.Generator().manual_seed(1)
        self.batch, self.block, self.device = size["batch"], size["block_size"], device
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                         if precision == "bf16" else contextlib.nullcontext())

    def steps(self, n: int) -> tuple[float, float]:
        """Wall seconds for n steps, and the part of it spent in the control."""
        ctl_s = 0.0
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
            if self.ctl is not None:
                sync(self.device)
                t1 = time.perf_counter()
                self.ctl.step()
                sync(self.device)
                ctl_s += time.perf_counter() - t1
        sync(self.device)
        return time.perf_counter() - t0, ctl_s


def bench(name: str, steps: int, reps: int, device: torch.device,
          precision: str) -> dict[str, float]:
    size = SIZES[name]
    runners = {v: Runner(size, v, device, precision) for v in VARIANTS}
    for r in runners.values():
        r.steps(1)  # warm-up (allocator, kernels), not timed
    per_step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ctl_step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(reps):
        for v in VARIANTS:
            wall, ctl = runners[v].steps(steps)
            per_step[v].append(wall / steps)
            ctl_step[v].append(ctl / steps)
        print(f"  {name} rep {rep + 1}: " + ", ".join(
            f"{v} {1e3 * per_step[v][-1]:.1f} ms" for v in VARIANTS), flush=True)
    base = statistics.median(per_step["none"])
    print(f"{name}: {size['n_layer']} layers x {size['n_embd']}, batch {size['batch']} x "
          f"{size['block_size']}, {steps} steps x {reps} reps, {device.type} {precision}")
    print(f"  {'variant':<8}{'ms/step':>10}{'control ms':>12}{'vs none':>10}{'control share':>15}")
    shares = {}
    for v in VARIANTS:
        med = statistics.median(per_step[v])
        ctl = statistics.median(ctl_step[v])
        shares[v] = ctl / base
        print(f"  {v:<8}{1e3 * med:>10.1f}{1e3 * ctl:>12.1f}{100 * (med / base - 1):>9.1f}%"
              f"{100 * shares[v]:>14.1f}%")
    for v in ("layer", "head"):  # the invariant still holds at this size
        r = runners[v]
        err = float(((r.ctl.current_pr() - r.ctl.pr0).abs() / r.ctl.pr0).max())
        print(f"  hold/{v}: max relative |PR_K - PR0| after the run = {err:.1e}")
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["demo", "paper"], choices=list(SIZES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--demo-steps", type=int, default=20)
    parser.add_argument("--paper-steps", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=0, help="0 = torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}")
    results = {}
    for name in args.sizes:
        steps = args.demo_steps if name == "demo" else args.paper_steps
        results[name] = bench(name, steps, args.reps, device, args.precision)
    print("overhead share of key control (hold; time in control.step / step time without "
          "control): " + "; ".join(f"{n} layer {100 * s['layer']:.1f}%, head "
                                   f"{100 * s['head']:.1f}%" for n, s in results.items()))


if __name__ == "__main__":
    main()
