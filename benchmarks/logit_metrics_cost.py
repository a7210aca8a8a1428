"""What ``logit_max`` and ``logit_delta`` add to a probe (the stability metrics).

The claim it checks: the two metrics of attention-logit growth cost at most 1 % of a probe.
Timed, interleaved per rep on the preset's model and probe set (``qkgeom.measure``, as the
trainer's probes call it): the probe as shipped (``logit_max`` read off the softmax, and
``logit_delta`` against the previous probe's window) and the reference, the same probe with
the ``logit_max`` bookkeeping switched off and no previous window (what a probe cost
before the metrics). Last line: the extra cost per probe at each size.

    python benchmarks/logit_metrics_cost.py [--quick] [--sizes small paper] [--reps 15]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

import torch
from _common import SIZES, sample_config, summary

from qkgeom import GPT, measure
from qkgeom.data import load_prepared, probe_set
from qkgeom.geometry.entropy import StreamingEntropy


@contextlib.contextmanager
def without_logit_max() -> Iterator[None]:
    """The entropy rows without the largest-logit bookkeeping (the reference's probe)."""
    original = StreamingEntropy._entropy_rows

    def rows(s, logp, neg_ent, top, peak=None, first=None):
        original(s, logp, neg_ent, top, None, first)
        if peak is not None:
            peak.zero_()  # the row mean is still added: a few (B·H, T) adds

    StreamingEntropy._entropy_rows = staticmethod(rows)
    try:
        yield
    finally:
        StreamingEntropy._entropy_rows = staticmethod(original)


def timings(size: str, reps: int, threads: int) -> tuple[list[float], list[float]]:
    """(shipped probe seconds, reference probe seconds) per rep."""
    cfg = sample_config(size, 10, threads=threads)
    model = GPT(cfg.model, generator=torch.Generator().manual_seed(0)).eval()
    tokens = probe_set(load_prepared(cfg.data).val, cfg.probe_sequences, cfg.model.block_size)
    previous = measure(model, tokens, batch_size=cfg.probe_batch)  # also the warm-up
    with without_logit_max():
        measure(model, tokens, batch_size=cfg.probe_batch)
    shipped, reference = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        measure(model, tokens, batch_size=cfg.probe_batch, previous=previous)
        shipped.append(time.perf_counter() - t0)
        with without_logit_max():
            t0 = time.perf_counter()
            measure(model, tokens, batch_size=cfg.probe_batch)
            reference.append(time.perf_counter() - t0)
    return shipped, reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["small", "paper"], choices=list(SIZES))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="5 reps")
    args = ap.parse_args()
    if args.quick:
        args.reps = 5
    torch.set_num_threads(args.threads)
    extra = {}
    for size in args.sizes:
        shipped, reference = timings(size, args.reps, args.threads)
        extra[size] = statistics.median(shipped) / statistics.median(reference) - 1
        print(f"{size}: probe with logit_max + logit_delta "
              f"{summary([1e3 * s for s in shipped], '.1f')} ms, without "
              f"{summary([1e3 * s for s in reference], '.1f')} ms", flush=True)
    print("extra probe cost of logit_max + logit_delta: "
          + "; ".join(f"{k} {100 * v:+.2f}%" for k, v in extra.items()))


if __name__ == "__main__":
    main()
