"""Will a run fit? Up-front estimates of memory and probe time, checked before any work.

Why: a batch size or context that cannot fit used to surface as an allocation traceback
(or the kernel's OOM kill) after the run folder was written, and a huge context as a first
probe that ran for many minutes without a word. The estimates here are deliberately
simple sums (docs/faults.md#resources) of the big terms, compared with what the device has:

- **training memory**: fp32 weights, gradients and AdamW's two moments (16 bytes per
  parameter); activations kept for the backward pass, about ``ACT_FLOATS_PER_DIM`` values
  per batch × context × layer × model width (the usual count for a GPT block without its
  attention matrix); the logits and their gradient (3 floats per
  batch × context × vocabulary); the probe's float64 forward (one layer's
  ``probe_batch × heads × context²`` attention scores plus q/k captures). Fused attention
  kernels keep no context² term in training, so none is counted there.
- **available memory**: free memory of the CUDA device (``torch.cuda.mem_get_info``), else
  the system's available memory (``MemAvailable`` of ``/proc/meminfo``, else
  ``os.sysconf``).
- **probe time**: the attention-entropy work of one probe, ``probe_sequences × layers ×
  heads × T(T+1)/2`` causal scores at ``4·head_dim + 16`` float64 operations each, at
  :data:`PROBE_FLOPS` per second (CPU: one core runs about 6.5e9 of them in the probe's
  kernels; accelerators: a conservative float64 rate). The rate does not scale with the
  thread count on purpose: a config is refused or not whatever machine reads it. A probe estimated above
  :data:`PROBE_LIMIT_S` is refused: its context makes the O(T²) probe absurd.

A run that passes and still runs out of memory (an estimate is an estimate) stops with one
line and ``status: failed`` (:func:`is_out_of_memory`), never a traceback.

- **CPU time**: a run that lands on a CPU (``device: auto`` on a machine without a GPU) is
  not refused, but one whose training FLOPs (:func:`qkgeom.model.flops_per_token` × its
  tokens) would take more than :data:`LONG_CPU_S` at :data:`CPU_TRAIN_FLOPS` gets one
  warning with the estimate (:func:`warn_if_long_on_cpu`). The rate is deliberately
  generous (a many-core workstation; the 2-core dev machine trains the demo model at about
  a tenth of it), so the estimate is a lower bound and small runs never warn.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

import torch

from qkgeom.errors import QKGeomError

if TYPE_CHECKING:
    from qkgeom.config import TrainConfig

__all__ = ["CPU_TRAIN_FLOPS", "LONG_CPU_S", "PROBE_LIMIT_S", "available_memory",
           "check_training_fits", "cpu_seconds", "duration", "gib", "is_out_of_memory",
           "probe_seconds", "require_memory", "training_memory", "warn_if_long_on_cpu"]

ACT_FLOATS_PER_DIM = 17  # activation values kept per token, layer and model dimension
PROBE_FLOPS = {"cpu": 5e9, "other": 1e12}  # float64 operations per second, per probe
PROBE_LIMIT_S = 60.0
CPU_TRAIN_FLOPS = 1e11  # training FLOP/s of a fast CPU (fp32): generous, so a lower bound
LONG_CPU_S = 3600.0  # runs estimated longer than this on a CPU are warned about


def gib(n: float) -> str:
    """Bytes as ``12.3 GiB``."""
    return f"{n / 2**30:,.1f} GiB"


def available_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes free for this run, where that number comes from); None when unknown."""
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available system memory"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                "available system memory")
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def require_memory(terms: dict[str, float], device: torch.device, advice: str) -> None:
    """QKGeomError (one line, the estimate itemised) when ``terms`` (bytes) add up to more
    than the device has available; nothing when it fits or the device cannot tell."""
    need = sum(terms.values())
    have, where = available_memory(device)
    if have is None or need <= have:
        return
    parts = ", ".join(f"{k} {gib(v)}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1])
                      if v >= 2**20)
    raise QKGeomError(f"needs about {gib(need)} of memory ({parts}) but the {where} is "
                      f"{gib(have)}; {advice}")


def _n_params(cfg: TrainConfig) -> int:
    m = cfg.model
    d = m.n_embd
    return m.n_layer * (12 * d * d + 13 * d) + (m.vocab_size + m.block_size + 1) * d


def training_memory(cfg: TrainConfig) -> dict[str, float]:
    """The big memory terms of training ``cfg`` (bytes; see the module doc)."""
    m = cfg.model
    act_bytes = 4 if cfg.effective_precision == "fp32" else 2
    tokens = cfg.batch_size * m.block_size
    probe_tokens = cfg.probe_batch * m.block_size
    return {
        "weights+AdamW": 16.0 * _n_params(cfg),
        "activations": float(ACT_FLOATS_PER_DIM * act_bytes * tokens * m.n_layer * m.n_embd),
        "logits": 3.0 * 4 * tokens * m.vocab_size,
        "probe": 8.0 * (cfg.probe_batch * m.n_head * m.block_size ** 2
                        + 4 * probe_tokens * m.n_layer * m.n_embd),
    }


def probe_seconds(cfg: TrainConfig, device: torch.device) -> float:
    """Estimated seconds of one probe of ``cfg`` on ``device`` (see the module doc)."""
    m = cfg.model
    scores = cfg.probe_sequences * m.n_layer * m.n_head * m.block_size * (m.block_size + 1) / 2
    flops = scores * (4 * (m.n_embd // m.n_head) + 16)
    return flops / PROBE_FLOPS["cpu" if device.type == "cpu" else "other"]


def check_training_fits(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse, before anything is written, a run whose probe would take absurdly long or
    whose memory estimate exceeds what ``device`` has."""
    seconds = probe_seconds(cfg, device)
    if seconds > PROBE_LIMIT_S:
        m = cfg.model
        raise QKGeomError(
            f"model.block_size {m.block_size} makes each probe absurdly long: about "
            f"{seconds:,.0f} s on {device.type} (probe_sequences {cfg.probe_sequences} × "
            f"{m.n_layer} layers × {m.n_head} heads × {m.block_size}²/2 causal attention scores "
            f"in float64; limit {PROBE_LIMIT_S:.0f} s); lower block_size or probe_sequences")
    require_memory(training_memory(cfg), device,
                   "lower batch_size, block_size or the model size, or use a larger device")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is the host or an accelerator running out of memory."""
    if isinstance(err, MemoryError):
        return True
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    if oom and isinstance(err, oom):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def cpu_seconds(cfg: TrainConfig) -> float:
    """A lower bound on the seconds training ``cfg`` takes on a CPU: its training FLOPs
    (:func:`qkgeom.model.flops_per_token` × steps × batch × context) at
    :data:`CPU_TRAIN_FLOPS`. Probes and evals are not counted."""
    from qkgeom.model import flops_per_token

    tokens = cfg.steps * cfg.batch_size * cfg.model.block_size
    return flops_per_token(cfg.model) * tokens / CPU_TRAIN_FLOPS


def duration(seconds: float) -> str:
    """``45 min``, ``3.2 hours``, ``5.1 days``."""
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 86400:.1f} days"


def warn_if_long_on_cpu(cfg: TrainConfig, device: torch.device, runs: int = 1) -> float:
    """One warning when ``runs`` runs of ``cfg`` on ``device`` (a CPU) would take longer
    than :data:`LONG_CPU_S` by :func:`cpu_seconds`; returns the estimate (seconds, all
    runs). Nothing on an accelerator."""
    if device.type != "cpu":
        return 0.0
    total = cpu_seconds(cfg) * runs
    if total > LONG_CPU_S:
        what = f"{runs} runs of this size" if runs > 1 else "this run"
        warnings.warn(f"{what} will take at least {duration(total)} on this CPU "
                      f"({cfg.steps:,} steps × {cfg.batch_size} × {cfg.model.block_size} "
                      "tokens); train on a GPU (--device auto finds one), or choose a smaller "
                      "--preset or --steps", stacklevel=3)
    return total
