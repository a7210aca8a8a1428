"""Training tokens/s of ``qkgeom.train()`` (probes on, default cadence) vs a plain PyTorch loop.

Both train the same GPT on the same prepared data in this process, interleaved
(plain, qkgeom, plain, qkgeom, ...) so machine noise hits both alike; the medians are
compared. The plain loop is the nanoGPT pattern: random windows from the memmap, forward,
backward, clip, AdamW step; no probes, no eval, no checkpoints. qkgeom's time includes
everything it does at the demo cadence (probes, eval, checkpoints, Parquet writes), scaled
to the run length given. Last line: the ratio.

    python benchmarks/train_throughput.py [--steps 300] [--threads 1 2] [--reps 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from qkgeom import GPT, make_config, probe, train
from qkgeom.data import ensure_sample_data, load_prepared, probe_set


def plain_loop(cfg, data: np.ndarray, steps: int) -> float:
    """tokens/s of a minimal loop; the same model class, init, optimiser and batch size."""
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay, fused=True)
    B, T = cfg.batch_size, cfg.model.block_size
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for _ in range(steps):
        ix = rng.integers(0, len(data) - T - 1, B)
        x = torch.from_numpy(np.stack([data[i:i + T] for i in ix]).astype(np.int64))
        y = torch.from_numpy(np.stack([data[i + 1:i + 1 + T] for i in ix]).astype(np.int64))
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        float(loss.detach())
    return steps * B * T / (time.perf_counter() - t0)


def qkgeom_loop(cfg, tmp: Path) -> tuple[float, float]:
    """(tokens/s of ``train`` end to end, wall seconds)."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    t0 = time.perf_counter()
    train(cfg, out / "run")
    wall = time.perf_counter() - t0
    return cfg.steps * cfg.batch_size * cfg.model.block_size / wall, wall


def probe_seconds(cfg, val: np.ndarray, reps: int = 3) -> float:
    model = GPT(cfg.model)
    tokens = probe_set(val, cfg.probe_sequences, cfg.model.block_size)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        probe(model, tokens, batch_size=cfg.probe_batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    data_dir = ensure_sample_data()
    data = load_prepared(data_dir)
    base = make_config(args.preset, {"data": str(data_dir), "steps": args.steps})
    from qkgeom.config import with_vocab

    base = with_vocab(base, data.vocab.vocab_size)
    print(f"preset {args.preset}: {base.model.n_layer} layers, n_embd {base.model.n_embd}, "
          f"block {base.model.block_size}, batch {base.batch_size}, {args.steps} steps, "
          f"probe_every {base.probe_every}, eval_every {base.eval_every}")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for threads in args.threads:
            torch.set_num_threads(threads)
            cfg = make_config(args.preset, {"data": str(data_dir), "steps": args.steps,
                                            "threads": threads})
            plain, ours = [], []
            for _ in range(args.reps):
                plain.append(plain_loop(base, data.train, args.steps))
                ours.append(qkgeom_loop(cfg, Path(tmp))[0])
            p, q = statistics.median(plain), statistics.median(ours)
            n_probes = args.steps // cfg.probe_every + 1 + (args.steps % cfg.probe_every != 0)
            t_probe = probe_seconds(base, data.val)
            wall = args.steps * cfg.batch_size * cfg.model.block_size / q
            share = n_probes * t_probe / wall
            print(f"threads {threads}: plain {p:,.0f} tok/s (runs {', '.join(f'{v:,.0f}' for v in plain)}); "
                  f"qkgeom {q:,.0f} tok/s (runs {', '.join(f'{v:,.0f}' for v in ours)}); "
                  f"ratio {q / p:.3f}; probe {t_probe * 1e3:.0f} ms x {n_probes} = "
                  f"{100 * share:.1f}% of run time")
            ratios.append(q / p)
    print(f"ratio qkgeom/plain tokens/s (probes on, median over thread counts): "
          f"{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
