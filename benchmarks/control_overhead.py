"""Time per training step with and without the key-spectrum control (E3).

The claim it checks (issue 13): the control costs at most 10 % of a training step at the
paper's size (6 x 384, context 256, batch 64) and at most 5 % at the small preset's (4 x 128,
context 64, batch 32) on one CPU thread, for ``hold`` and ``shrink`` at the token level with
the ``data`` rule (E3's primary arms) and at the weight level with the ``data`` and the
``frobenius`` scale rule, layer scope. Identical models (same init, same random
tokens, fused AdamW as in the trainer) train side by side: no control and the four
controlled variants. ``shrink`` has dose 0.5 reached at once (no ramp, base = PR0), so its
cap binds at every step: the worst case, every unit reshaped every step. Timed blocks run
interleaved (rep 1 of every variant, then rep 2, ...) so machine noise hits them alike;
medians are compared.

"control ms" is the time inside ``KeySpectrumControl.step`` plus, for the data rule, the
time inside its input hooks (xᵀx of the key projection's input during the forward pass),
timed directly; it includes the control's records (with Σ: the PR on Σ without ε and, out
of sample, the previous step's keys on this step's batch, two products per layer); "control share" divides it by the step time of the uncontrolled model.
"vs none" is the difference of whole step times (noisier: the share is the claim).

    python benchmarks/control_overhead.py [--sizes small paper] [--reps 3]
        [--small-steps 20] [--paper-steps 2] [--device cpu] [--precision fp32] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import torch

from qkgeom.config import GPTConfig
from qkgeom.control import KeySpectrumControl
from qkgeom.model import GPT

SIZES = {
    "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch=32),
    "paper": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch=64),
}
# variant -> (mode, level, scale); None = no control
VARIANTS: dict[str, tuple[str, str, str] | None] = {
    "none": None, "hold-token-data": ("hold", "token", "data"),
    "shrink-token-data": ("shrink", "token", "data"),
    "hold-weight-data": ("hold", "weight", "data"),
    "hold-weight-frobenius": ("hold", "weight", "frobenius"),
    "shrink-weight-data": ("shrink", "weight", "data"),
    "shrink-weight-frobenius": ("shrink", "weight", "frobenius")}
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
        self.device, self.hook_s = device, 0.0
        self.ctl = None
        spec = VARIANTS[variant]
        if spec is not None:
            mode, level, scale = spec
            self.ctl = KeySpectrumControl.attach(self.model, mode, level=level, scale=scale,
                                                 ramp_steps=0)
            if self.ctl.moments is not None:  # the same hooks, with a stopwatch around them
                self.ctl.moments.remove()
                for j, site in enumerate(self.ctl.sites):
                    site.k_module.register_forward_pre_hook(self._timed(self.ctl.moments.hook(j)))
        self.gen = torch.Generator().manual_seed(1)
        self.batch, self.block = size["batch"], size["block_size"]
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                         if precision == "bf16" else contextlib.nullcontext())

    def _timed(self, hook: Any) -> Any:
        def timed(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            sync(self.device)
            t0 = time.perf_counter()
            hook(module, args)
            sync(self.device)
            self.hook_s += time.perf_counter() - t0
        return timed

    def steps(self, n: int) -> tuple[float, float]:
        """Wall seconds for n steps, and the part of it spent in the control."""
        ctl_s, self.hook_s = 0.0, 0.0
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
        return time.perf_counter() - t0, ctl_s + self.hook_s


def bench(name: str, steps: int, reps: int, device: torch.device,
          precision: str) -> dict[str, float]:
    size = SIZES[name]
    runners = {v: Runner(size, v, device, precision) for v in VARIANTS}
    for r in runners.values():
        r.steps(1)  # warm-up (allocator, kernels, S initialised), not timed
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
          f"{size['block_size']}, {steps} steps x {reps} reps, {device.type} {precision}, "
          f"{torch.get_num_threads()} threads")
    print(f"  {'variant':<18}{'ms/step':>10}{'control ms':>12}{'vs none':>10}"
          f"{'control share':>15}")
    shares = {}
    for v in VARIANTS:
        med = statistics.median(per_step[v])
        ctl = statistics.median(ctl_step[v])
        shares[v] = ctl / base
        print(f"  {v:<18}{1e3 * med:>10.1f}{1e3 * ctl:>12.2f}{100 * (med / base - 1):>9.1f}%"
              f"{100 * shares[v]:>14.1f}%")
    for v, r in runners.items():  # the control still does its job at this size
        if r.ctl is not None:
            target = r.ctl.pr0 * (0.5 if v.startswith("shrink") else 1.0)
            err = float(((r.ctl.current_pr() - target).abs() / target).max())
            print(f"  {v}: max relative |PR_K - target| after the run = {err:.1e}")
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "paper"], choices=list(SIZES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--small-steps", type=int, default=20)
    parser.add_argument("--paper-steps", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=1, help="0 = torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}")
    results = {}
    for name in args.sizes:
        steps = args.small_steps if name == "small" else args.paper_steps
        results[name] = bench(name, steps, args.reps, device, args.precision)
    limit = {"small": 5.0, "paper": 10.0}
    print("control share of a training step (time in the control / step time without it; "
          "limit small 5 %, paper 10 %): " + "; ".join(
              f"{n} " + ", ".join(f"{v} {100 * s:.1f}%" for v, s in r.items() if v != "none")
              + f" (limit {limit[n]:.0f}%)" for n, r in results.items()))


if __name__ == "__main__":
    main()
