"""Checkpoint-analysis throughput and memory (qkgeom.checkpoints.analyze_model).

Claims measured, all in this one run on one small model built from a config (4 layers ×
128, 4 heads, context 128, windows of 128, batch 32; the weights do not matter for speed):
GPT-2 style by default, ``--arch llama`` for a rotary model (Llama layout, 4 query and 2
key heads), where the default pre-rotary site also keeps the post-rotary covariances:

1. tokens/s of the streaming analysis against a plain ``inference_mode`` forward pass of
   the same model over the same windows (target ≥ 0.8×). Both run in one process,
   interleaved (forward, analysis, forward, analysis, ...) after a warm-up, so machine
   noise hits them alike; medians and ranges are reported, per thread count (``--threads
   1,2``: on a busy 2-core machine, 2 OpenMP threads stall at every operator's barrier,
   which slows the forward 2-3× and penalises code by its number of operators);
2. peak resident memory against the token count (10k → 1M tokens), each size in a fresh
   subprocess (``ru_maxrss``): flat, because only O(L·(H·hd)²) accumulators are kept;
3. a naive baseline that caches every q/k and then takes an SVD of the stacked, centred
   activations: its memory grows with the token count (run up to 100k tokens);
4. rotary models only: the cost of the post-rotary covariances (``pr_*_token_post``), as
   the time of the default analysis (pre-rotary site, both covariances) over that of a
   post-rotary one (one site), interleaved in the same rounds;
5. the cost of 8 token blocks (``blocks=8``, E4's bootstrap: a second set of running
   totals), as the time of a blocked analysis over the plain one, in the same rounds;
6. the cost of the scale-free entropy (``attn_entropy_scalefree``: a second softmax of
   each score block, its rows divided by their own standard deviation), as the time of the
   analysis over that of the same analysis with that softmax patched out, in the same
   rounds.

Run: ``python benchmarks/analysis_throughput.py [--arch gpt2|llama] [--tokens 1000000]
[--threads 1,2] [--quick]``. The last line printed is the analysis/forward throughput ratio
(median, first thread count).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

SEQ, BATCH = 128, 32
TEXT = ("Anthropology is the study of humans and their societies in the past and present. "
        "Its main subdivisions are social anthropology and cultural anthropology.\n") * 2000


class Chars:
    """Character ids modulo the vocabulary: a tokenizer with no files."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]


ARCH = "gpt2"  # set from --arch


def model():
    torch.manual_seed(0)
    if ARCH == "llama":
        from transformers import LlamaConfig, LlamaModel

        cfg = LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          hidden_size=128, intermediate_size=512, max_position_embeddings=SEQ,
                          vocab_size=256, attn_implementation="sdpa")
        return LlamaModel(cfg).eval()
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(n_layer=4, n_head=4, n_embd=128, n_positions=SEQ, vocab_size=256,
                     attn_implementation="sdpa")
    return GPT2Model(cfg).eval()


def texts():
    while True:
        yield TEXT


def analysis_run(n_tokens: int) -> dict:
    from qkgeom.checkpoints import analyze_model

    m = model()
    t0 = time.perf_counter()
    frame = analyze_model(m, Chars(), texts, max_tokens=n_tokens, seq_len=SEQ, batch_size=BATCH)
    dt = time.perf_counter() - t0
    return {"tokens": frame.attrs["tokens"], "seconds": dt, "tokens_per_s": n_tokens / dt,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


@torch.inference_mode()
def forward_run(n_tokens: int) -> dict:
    m = model()
    ids = torch.tensor(Chars().encode(TEXT * math.ceil(n_tokens / len(TEXT)))[:n_tokens])
    ids = ids[: (n_tokens // SEQ) * SEQ].view(-1, SEQ)
    t0 = time.perf_counter()
    for b in ids.split(BATCH):
        m(input_ids=b, use_cache=False)
    dt = time.perf_counter() - t0
    return {"tokens": ids.numel(), "seconds": dt, "tokens_per_s": ids.numel() / dt}


@torch.inference_mode()
def naive_run(n_tokens: int) -> dict:
    """Cache every layer's q and k, then PR from an SVD of the centred stack."""
    from qkgeom.arch import adapter_for

    m = model()
    adapter = adapter_for(m)
    cache: dict[int, list] = {i: [] for i in range(adapter.n_layer)}

    def keep(i, qs, ks, q, k, scale):
        cache[i].append((q.transpose(1, 2).reshape(-1, q.shape[1] * q.shape[3]).clone(),
                         k.transpose(1, 2).reshape(-1, k.shape[1] * k.shape[3]).clone()))

    ids = torch.tensor(Chars().encode(TEXT * math.ceil(n_tokens / len(TEXT)))[:n_tokens])
    ids = ids[: (n_tokens // SEQ) * SEQ].view(-1, SEQ)
    t0 = time.perf_counter()
    with adapter.capture(keep):
        for b in ids.split(BATCH):
            m(input_ids=b, use_cache=False)
    prs = []
    for i in range(adapter.n_layer):
        for j in (0, 1):
            x = torch.cat([p[j] for p in cache[i]]).double()  # (N, D)
            s = torch.linalg.svdvals(x - x.mean(0)) ** 2
            prs.append(float(s.sum() ** 2 / (s**2).sum()))
    dt = time.perf_counter() - t0
    return {"tokens": ids.numel(), "seconds": dt, "tokens_per_s": ids.numel() / dt,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def speed_run(n_tokens: int, rounds: int) -> dict:
    """Forward and analysis of the same ``n_tokens`` tokens, interleaved ``rounds`` times
    after one untimed warm-up of each; wall seconds per round."""
    from qkgeom.checkpoints import analyze_model

    m = model()
    ids = torch.tensor(Chars().encode(TEXT * math.ceil(n_tokens / len(TEXT)))[:n_tokens])
    ids = ids[: (n_tokens // SEQ) * SEQ].view(-1, SEQ)

    def forward() -> None:
        with torch.inference_mode():
            for b in ids.split(BATCH):
                m(input_ids=b, use_cache=False)

    def analysis(site: str = "pre-rotary", blocks: int = 1) -> None:
        analyze_model(m, Chars(), texts, max_tokens=ids.numel(), seq_len=SEQ, batch_size=BATCH,
                      qk_site=site, blocks=blocks)

    def without_scale_free() -> None:
        from qkgeom.geometry.entropy import StreamingEntropy

        real = StreamingEntropy._entropy_rows

        def raw_only(s, logp, neg_ent, top):  # the scale-free call is the one without top
            if top is not None:
                real(s, logp, neg_ent, top)

        StreamingEntropy._entropy_rows = staticmethod(raw_only)
        try:
            analysis()
        finally:
            StreamingEntropy._entropy_rows = staticmethod(real)

    runs = [("forward", forward), ("analysis", analysis), ("blocks8", lambda: analysis(blocks=8)),
            ("no_scale_free", without_scale_free)]
    if ARCH == "llama":  # the same analysis without the post-rotary covariances
        runs.append(("post_site", lambda: analysis("post-rotary")))
    out: dict = {"tokens": ids.numel(), **{name: [] for name, _ in runs}}
    for rep in range(rounds + 1):
        for name, fn in runs:
            t0 = time.perf_counter()
            fn()
            if rep:  # round 0 is the warm-up
                out[name].append(time.perf_counter() - t0)
    return out


def child(kind: str, n: int, threads: int, rounds: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--tokens", str(n), "--threads",
           str(threads), "--rounds", str(rounds), "--arch", ARCH]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1_000_000, help="largest token count")
    ap.add_argument("--threads", default="", help="thread counts, e.g. 1,2 (default: torch's)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved speed rounds")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and sizes (≤ 100k)")
    ap.add_argument("--arch", default="gpt2", choices=("gpt2", "llama"))
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    global ARCH
    ARCH = args.arch
    threads = [int(t) for t in args.threads.split(",") if t] or [torch.get_num_threads()]
    if args.child:
        torch.set_num_threads(threads[0])
        if args.child == "speed":
            print(json.dumps(speed_run(args.tokens, args.rounds)))
            return
        fn = {"analysis": analysis_run, "naive": naive_run, "forward": forward_run}[args.child]
        print(json.dumps(fn(args.tokens)))
        return

    if args.quick:
        args.rounds, args.tokens = min(args.rounds, 3), min(args.tokens, 100_000)
    n_speed = 32 * BATCH * SEQ  # 131,072 tokens: 32 batches per timed run
    print(f"model: {ARCH} 4 x 128, 4 heads, windows of {SEQ}, batch {BATCH}; "
          f"{n_speed:,} tokens per timed run, {args.rounds} interleaved rounds")
    ratios = []
    for t in threads:
        r = child("speed", n_speed, t, args.rounds)
        fwd = [r["tokens"] / s for s in r["forward"]]
        ana = [r["tokens"] / s for s in r["analysis"]]
        per_round = [a / f for a, f in zip(ana, fwd, strict=True)]
        ratio = statistics.median(ana) / statistics.median(fwd)
        ratios.append(ratio)
        print(f"{t} thread(s): plain forward {statistics.median(fwd):>9,.0f} tokens/s "
              f"({min(fwd):,.0f}-{max(fwd):,.0f}); analysis {statistics.median(ana):>9,.0f} "
              f"tokens/s ({min(ana):,.0f}-{max(ana):,.0f}); ratio of medians {ratio:.2f} "
              f"(per round {min(per_round):.2f}-{max(per_round):.2f})")
        costs = [("8 token blocks", "blocks8", "analysis"),
                 ("scale-free entropy", "analysis", "no_scale_free")]
        if "post_site" in r:
            costs.append(("post-rotary covariances", "analysis", "post_site"))
        for what, with_it, without in costs:
            cost = [a / b for a, b in zip(r[with_it], r[without], strict=True)]
            print(f"  {what}: analysis time x{statistics.median(cost):.2f} of the analysis "
                  f"without it (per round {min(cost):.2f}-{max(cost):.2f})")

    sizes = [n for n in (10_000, 100_000, 1_000_000) if n <= args.tokens]
    print(f"peak memory (RSS of a fresh process, {threads[0]} thread(s)) against tokens:")
    base = None
    for n in sizes:
        r = child("analysis", n, threads[0])
        base = base or r["maxrss_mb"]
        print(f"  analysis {n:>9,} tokens: {r['maxrss_mb']:7.0f} MB "
              f"({r['maxrss_mb'] / base:.2f}x of 10k) {r['tokens_per_s']:9,.0f} tokens/s")
    for n in [n for n in sizes if n <= 100_000]:
        r = child("naive", n, threads[0])
        print(f"  naive    {n:>9,} tokens: {r['maxrss_mb']:7.0f} MB "
              f"{r['tokens_per_s']:9,.0f} tokens/s (cache all q/k, then SVD)")
    print(f"analysis / forward throughput ratio ({threads[0]} thread(s)): {ratios[0]:.2f}")
    print(f"{ratios[0]:.3f}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
