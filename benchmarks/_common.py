"""Shared pieces of the benchmark scripts: sizes, the plain loop, timed qkgeom runs, peaks.

Timing conventions (every script): the first ``WARMUP`` steps of a run are never timed
(allocator, kernel selection, torch.compile's first compile); variants run interleaved
(rep 1 of every variant, then rep 2, ...) so that machine noise hits them alike; medians
and ranges are reported and the ratios compare medians of one script run.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from qkgeom import GPT, make_config, train
from qkgeom.config import TrainConfig, with_vocab
from qkgeom.data import ensure_sample_data, load_prepared
from qkgeom.training import Callback, TrainContext

WARMUP = 3
# The two sizes of issue 6. ``paper`` is the paper preset's model (6 x 384, context 256);
# its batch is cut from 64 to 8 sequences on CPU so a timed step takes ~1-2 s, not 15 s.
SIZES = {
    "small": dict(preset="small", batch=32, cadence=100),
    "paper": dict(preset="paper", batch=8, cadence=500),
}


def sample_config(size: str, steps: int, *, threads: int, precision: str = "fp32",
                  compile: bool = False, device: str = "cpu") -> TrainConfig:
    """The preset's model on the embedded sample; probe, eval and checkpoint once, at the
    end (``cadence`` in :data:`SIZES` says how often they really come)."""
    spec = SIZES[size]
    data = ensure_sample_data()
    cfg = make_config(spec["preset"], {
        "data": str(data), "steps": steps, "batch_size": spec["batch"],
        "warmup_steps": min(10, steps), "probe_every": steps, "eval_every": steps,
        "checkpoint_every": steps, "log_every": steps, "precision": precision,
        "compile": compile, "threads": threads, "device": device})
    return with_vocab(cfg, load_prepared(data).vocab.vocab_size)


class StepClock(Callback):
    """perf_counter at the end of every optimiser step (synchronised on CUDA)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_end(self, ctx: TrainContext) -> None:
        if next(ctx.model.parameters()).is_cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())


@dataclass
class Timed:
    hot_s: float  # steps WARMUP+1 .. N: the training loop as it runs between records
    steps: int  # steps in hot_s
    records_s: float  # the final boundary: one probe + eval + checkpoint + Parquet writes
    tokens_per_step: int
    cadence: int  # steps between probes in the real preset

    @property
    def hot_tokens_per_s(self) -> float:
        return self.steps * self.tokens_per_step / self.hot_s

    @property
    def tokens_per_s(self) -> float:
        """Hot loop plus one record boundary per ``cadence`` steps (eval and checkpoints come
        less often than probes in every preset, so this over-counts them: conservative)."""
        return self.steps * self.tokens_per_step / (
            self.hot_s + self.records_s * self.steps / self.cadence)


def timed_train(cfg: TrainConfig, cadence: int) -> Timed:
    """Run ``qkgeom.train`` and time its hot loop and its final record boundary."""
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, Path(tmp) / "run", callbacks=[clock])
        end = time.perf_counter()
    t = clock.times
    return Timed(hot_s=t[-1] - t[WARMUP - 1], steps=len(t) - WARMUP, records_s=end - t[-1],
                 tokens_per_step=cfg.batch_size * cfg.model.block_size, cadence=cadence)


def plain_loop(cfg: TrainConfig, data: np.ndarray, steps: int,
               device: str = "cpu") -> float:
    """tokens/s of a minimal nanoGPT-style loop over steps WARMUP+1 .. ``steps``: the same
    model class, init, fused AdamW, clipping and batch size, fp32, eager, no records."""
    dev = torch.device(device)
    model = GPT(cfg.model, generator=torch.Generator().manual_seed(0)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay, fused=True)
    B, T = cfg.batch_size, cfg.model.block_size
    rng = np.random.default_rng(0)
    t0 = 0.0
    for i in range(steps):
        if i == WARMUP:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        ix = rng.integers(0, len(data) - T - 1, B)
        x = torch.from_numpy(np.stack([data[j:j + T] for j in ix]).astype(np.int64)).to(dev)
        y = torch.from_numpy(np.stack([data[j + 1:j + 1 + T] for j in ix]).astype(np.int64))
        _, loss = model(x, y.to(dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        float(loss.detach())  # the usual per-step read-back
    return (steps - WARMUP) * B * T / (time.perf_counter() - t0)


def matmul_peak(dtype: torch.dtype, n: int = 1024, seconds: float = 1.0,
                device: str = "cpu") -> float:
    """Measured matmul FLOP/s of torch at this precision and thread count (best of 3)."""
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(3):
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            a @ b
            reps += 1
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0))
    return best


def with_steps(cfg: TrainConfig, steps: int) -> TrainConfig:
    return replace(cfg, steps=steps, probe_every=steps, eval_every=steps,
                   checkpoint_every=steps, log_every=steps)


def summary(values: list[float], fmt: str = ",.0f") -> str:
    """'median (min-max)'."""
    return (f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})")
