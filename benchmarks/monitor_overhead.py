"""Share of training time the GeometryMonitor costs at its default cadence (issue 8).

The claim it checks: probing every ``DEFAULT_EVERY`` = 200 optimiser steps costs at most
2 % of training time. Measured on CPU at a smallish GPT-2 (HF ``GPT2LMHeadModel`` with
GPT-2's 50 257-token vocabulary; default 4 layers × 256, 4 heads, context 128, batch
8 × 128 -- GPT-2 small is 12 × 768, context 1024, which is too slow to train on a shared
2-core CPU) with the monitor's defaults (metrics ``DEFAULT_METRICS``, 16 probe sequences
× context, the default alert rules, no TensorBoard/W&B):

- ``step_s``: median wall time of a training step (AdamW), over ``--reps`` blocks of
  ``--steps`` steps;
- ``probe_s``: median wall time of one probe (``GeometryMonitor.probe``);
- per-probe share = probe_s / step_s (one probe costs that many training steps) and the
  overhead at cadence ``every`` = probe_s / (every · step_s + probe_s);
- a direct check at a dense cadence (every ``--check-every`` steps): the measured slowdown of
  a monitored training loop against the same loop unmonitored, next to the prediction
  (blocks alternate ABBA; on a busy machine this difference is noisier than the
  component timings, which are what the last line uses).

Last line: the overhead share at the default cadence.

    python benchmarks/monitor_overhead.py [--reps 3] [--probes 3] [--check-every 4]
        [--n-layer 4] [--n-embd 256] [--n-head 4] [--context 128] [--batch 8] [--threads 0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qkgeom.monitor import DEFAULT_EVERY, GeometryMonitor

VOCAB, PROBE_SEQ = 50257, 16


def build(size: argparse.Namespace) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=size.n_layer, n_head=size.n_head, n_embd=size.n_embd,
                                  n_positions=size.context, vocab_size=VOCAB, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).train()


class Loop:
    """A model, AdamW and a token stream; ``run(n)`` trains n steps, probing if monitored."""

    def __init__(self, size: argparse.Namespace, monitor_every: int | None) -> None:
        self.model = build(size)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(1)
        self.batch, self.T = size.batch, size.context
        probe = torch.randint(0, VOCAB, (PROBE_SEQ, self.T),
                              generator=torch.Generator().manual_seed(2))
        self.mon = (GeometryMonitor(self.model, probe, every=monitor_every, wandb=False,
                                    tensorboard=None) if monitor_every else None)
        self.step = 0

    def run(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            x = torch.randint(0, VOCAB, (self.batch, self.T), generator=self.gen)
            loss = self.model(input_ids=x, labels=x).loss
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.step += 1
            if self.mon is not None:
                self.mon.step(self.step)
        return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--probes", type=int, default=3, help="timed probes")
    parser.add_argument("--check-every", type=int, default=4,
                        help="dense cadence of the direct check (= steps per timed block)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    plain, dense = Loop(args, None), Loop(args, args.check_every)
    n_params = sum(p.numel() for p in plain.model.parameters())
    print(f"GPT-2 {args.n_layer} x {args.n_embd}, {args.n_head} heads, vocab {VOCAB}, "
          f"{n_params / 1e6:.1f} M parameters; batch {args.batch} x {args.context}; probe "
          f"{PROBE_SEQ} x {args.context}; {torch.get_num_threads()} CPU threads", flush=True)
    plain.run(1)  # warm-up (allocator), not timed
    dense.mon.start(0)  # first probe: warm-up, not timed
    probe_times = [dense.mon.probe(1000 + i).seconds for i in range(args.probes)]
    probe_s = statistics.median(probe_times)
    # interleaved blocks so machine noise hits both alike; a block of check_every steps
    # ends with exactly one probe in the monitored loop
    plain_t, dense_t = [], []
    for rep in range(args.reps):
        order = (plain, dense) if rep % 2 == 0 else (dense, plain)  # ABBA: no order bias
        for loop in order:
            (plain_t if loop is plain else dense_t).append(
                loop.run(args.check_every) / args.check_every)
        print(f"  rep {rep + 1}: {plain_t[-1]:.3f} s/step plain, {dense_t[-1]:.3f} s/step "
              f"monitored every {args.check_every}", flush=True)
    step_s = statistics.median(plain_t)
    per_probe = probe_s / step_s
    predicted = probe_s / (args.check_every * step_s + probe_s)
    measured = statistics.median(dense_t) / step_s - 1
    print(f"training step: {step_s:.3f} s (median); probe: {probe_s:.3f} s (median of "
          f"{args.probes}: {', '.join(f'{t:.3f}' for t in probe_times)})")
    print(f"one probe costs {per_probe:.2f} training steps")
    print(f"check at every={args.check_every}: measured slowdown {100 * measured:.1f} %, "
          f"predicted {100 * predicted / (1 - predicted):.1f} %")
    share = probe_s / (DEFAULT_EVERY * step_s + probe_s)
    print(f"overhead at the default cadence (every {DEFAULT_EVERY} steps): {100 * share:.2f} % "
          "of training time")
    print(f"{share:.4f}")


if __name__ == "__main__":
    main()
