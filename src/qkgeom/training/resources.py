"""Will a run fit? Up-front estimates of memory and probe time, checked before any work.

A batch or context that cannot fit would otherwise surface as an allocation traceback (or
the kernel's OOM kill) after the run folder was written, and a huge context as a probe
running for minutes without a word. The estimates are deliberately simple sums of the big
terms, compared with what the device has; a run estimated long on a CPU gets one warning.
The terms and rates: docs/faults.md#resources.
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
# float64 operations per second of a probe; not scaled by the threads, so a config gets the
# same verdict on every machine
PROBE_FLOPS = {"cpu": 5e9, "other": 1e12}
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
    """A lower bound on the seconds training ``cfg`` takes on a CPU: its training FLOPs at
    :data:`CPU_TRAIN_FLOPS` (probes and evals not counted)."""
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


def warn_if_long_on_cpu(cfg: TrainConfig, device: torch.device) -> float:
    """One warning when training ``cfg`` on a CPU would take longer than :data:`LONG_CPU_S`;
    returns the estimate (seconds; 0 on an accelerator)."""
    if device.type != "cpu":
        return 0.0
    total = cpu_seconds(cfg)
    if total > LONG_CPU_S:
        warnings.warn(f"this run will take at least {duration(total)} on this CPU "
                      f"({cfg.steps:,} steps × {cfg.batch_size} × {cfg.model.block_size} "
                      "tokens); train on a GPU (--device auto finds one), or choose a smaller "
                      "--preset or --steps", stacklevel=3)
    return total
