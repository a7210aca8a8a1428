"""Frozen, typed run configuration: presets, overrides, validation, stable hash.

A run is fully described by one :class:`TrainConfig` (which nests the :class:`GPTConfig`),
so a sweep runner can build, hash and compare runs without touching globals. A config is
validated once, when it is built (each dataclass checks itself in ``__post_init__``, also
under ``dataclasses.replace``), so no reader checks it again: an unknown key or an
impossible value is a :class:`~qkgeom.errors.QKGeomError` (exit code 2) before any work,
never a crash an hour into training.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from qkgeom.errors import QKGeomError

QK_INITS = ("normal", "orthogonal", "tied")
# Reparametrisations of W_Q and W_K: none, or sigma (σReparam: γ·W/σ_max(W), docs/stability.md).
QK_REPARAMS = ("none", "sigma")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# auto = the best this machine has (detect_device): CUDA, then MPS, then CPU.
DEVICE_HELP = "auto (CUDA, then MPS, then CPU) | cpu | cuda | cuda:N | mps"
# every: each multiple of checkpoint_every; log: also step 0 and the powers of two below it
CHECKPOINT_SCHEDULES = ("every", "log")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the decoder-only GPT. ``vocab_size`` comes from the prepared data."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    vocab_size: int = 256
    dropout: float = 0.0
    bias: bool = False
    qk_init: str = "normal"
    qk_norm: bool = False  # LayerNorm of each head's q and k before the logits (qk-layernorm)
    qk_reparam: str = "none"  # none | sigma (σReparam of W_Q and W_K)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def __post_init__(self) -> None:
        _check_types(self, "model.")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise QKGeomError(f"model.{name} must be a positive integer, got {getattr(self, name)}")
        if self.block_size < 2:
            raise QKGeomError(f"model.block_size must be at least 2 (attention over one "
                              f"position has no entropy to measure), got {self.block_size}")
        if self.n_embd % self.n_head:
            raise QKGeomError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise QKGeomError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.qk_init not in QK_INITS:
            raise QKGeomError(f"unknown qk_init {self.qk_init!r}; choose one of {', '.join(QK_INITS)}")
        if self.qk_reparam not in QK_REPARAMS:
            raise QKGeomError(f"unknown model.qk_reparam {self.qk_reparam!r}; choose one of "
                              f"{', '.join(QK_REPARAMS)}")


@dataclass(frozen=True)
class KeyControlConfig:
    """Key-spectrum control during training (docs/definitions.md#key-spectrum-control).

    The one definition of the control's settings: :mod:`qkgeom.control` reads its allowed
    values from here, so the config stays torch-free and nothing is kept equal by hand.

    ``dose`` None means "not given": for shrink, sham and expand it is replaced by the mode's
    default (:attr:`DEFAULT_DOSE`) when the config is built, so an explicit default and an
    omitted one are the same run (one config hash); none and hold take no dose.
    """

    MODES = ("none", "hold", "shrink", "sham", "expand")
    LEVELS = ("token", "weight")
    SCALES = ("data", "frobenius")
    SCOPES = ("layer", "head")
    HOWS = ("post_step", "parametrize")
    # The dose of each mode that takes one, when none is given.
    DEFAULT_DOSE = {"shrink": 0.5, "sham": 1.0, "expand": 2.0}
    # Modes whose target is a cap relative to base(t): they may follow a reference run.
    CAPPED = ("shrink", "sham", "expand")

    mode: str = "none"  # none | hold | shrink | sham | expand
    level: str = "token"  # token (spectrum of W_K Σ W_Kᵀ, the keys' covariance) | weight (of W_K)
    scale: str = "data"  # data (key spread tr(W_K Σ W_Kᵀ), matched to the reference) | frobenius
    dose: float | None = None  # r: shrink (0, 1], expand >= 1, sham 1; None = the default
    reference: str = ""  # the paired uncontrolled run folder ("" = base is PR_K at step 0)
    ramp_steps: int = -1  # steps over which r(t) goes from 1 to dose; -1 = warmup_steps
    record: bool = False  # write key_pr.parquet (the per-step PR_K of every unit)
    scope: str = "layer"  # layer (whole W_K) | head (each head's slice)
    how: str = "post_step"  # post_step (project after each update) | parametrize

    def __post_init__(self) -> None:
        if self.dose is None and isinstance(self.mode, str) and self.mode in self.DEFAULT_DOSE:
            object.__setattr__(self, "dose", self.DEFAULT_DOSE[self.mode])
        prefix = "key_control."
        _check_types(self, prefix)
        for name, allowed in (("mode", self.MODES), ("level", self.LEVELS),
                              ("scale", self.SCALES), ("scope", self.SCOPES),
                              ("how", self.HOWS)):
            if getattr(self, name) not in allowed:
                raise QKGeomError(f"unknown {prefix}{name} {getattr(self, name)!r}; choose one "
                                  f"of {', '.join(allowed)}")
        mode, dose = self.mode, self.dose
        if mode in ("hold", "none"):
            if dose is not None:
                raise QKGeomError(f"{prefix}dose is not used by {mode}; got {dose} (leave it "
                                  "unset)")
        elif not math.isfinite(dose):
            raise QKGeomError(f"{prefix}dose must be a finite number, got {dose}")
        elif dose <= 0:
            raise QKGeomError(f"{prefix}dose must be > 0, got {dose} (leave it unset for the "
                              "mode's default)")
        if mode == "shrink" and not 0.0 < dose <= 1.0:
            raise QKGeomError(f"{prefix}dose must be in (0, 1] for shrink, got {dose}")
        if mode == "expand" and dose < 1.0:
            raise QKGeomError(f"{prefix}dose must be >= 1 for expand, got {dose}")
        if mode == "sham" and dose != 1.0:
            raise QKGeomError(f"{prefix}dose is fixed at 1 for sham; got {dose} (leave it "
                              "unset)")
        if self.reference and not (mode in self.CAPPED or (mode != "none"
                                                           and self.scale == "data")):
            raise QKGeomError(f"{prefix}reference is read by {', '.join(self.CAPPED)} (a cap "
                              "relative to a reference run) and by the data scale rule (the "
                              f"key spread matched to it); {mode} with the {self.scale} rule "
                              "reads nothing from it")
        if self.ramp_steps < -1:
            raise QKGeomError(f"{prefix}ramp_steps must be -1 (= warmup_steps) or >= 0, got "
                              f"{self.ramp_steps}")

    @property
    def active(self) -> bool:
        """Whether a callback must serve this section: a control, or only the recording."""
        return self.mode != "none" or self.record

    # E3 arm names, both ways, in one place: ``none``, ``<mode>-<level>-<scale>`` (hold,
    # sham), ``<mode>-<dose>-<level>-<scale>`` (shrink, expand), e.g. ``shrink-0.5-token-data``.

    @property
    def arm(self) -> str:
        """The E3 arm this section is (docs/definitions.md#e3-arms)."""
        if self.mode == "none":
            return "none"
        if self.mode in ("hold", "sham"):
            return f"{self.mode}-{self.level}-{self.scale}"
        return f"{self.mode}-{float(self.dose):g}-{self.level}-{self.scale}"

    @classmethod
    def arm_settings(cls, name: str) -> dict[str, Any]:
        """The ``key_control`` keys of the E3 arm called ``name`` (the inverse of
        :attr:`arm`); a one-line QKGeomError for a name that is not an arm."""
        parts = name.split("-")
        bad = QKGeomError(f"unknown E3 arm {name!r}; arms are none, sham-<level>-<scale>, "
                          "hold-<level>-<scale>, shrink-<dose>-<level>-<scale>, "
                          f"expand-<dose>-<level>-<scale> with level {' or '.join(cls.LEVELS)}"
                          f" and scale {' or '.join(cls.SCALES)}")
        if name == "none":
            return {"mode": "none"}
        if len(parts) < 3 or parts[-2] not in cls.LEVELS or parts[-1] not in cls.SCALES:
            raise bad
        out: dict[str, Any] = {"mode": parts[0], "level": parts[-2], "scale": parts[-1]}
        if parts[0] in ("hold", "sham") and len(parts) == 3:
            return out
        if parts[0] in ("shrink", "expand") and len(parts) == 4:
            try:
                out["dose"] = float(parts[1])
            except ValueError:
                raise bad from None
            return out
        raise bad


@dataclass(frozen=True)
class EntropyControlConfig:
    """The closed loop that steers each layer's attention entropy toward ``target`` nats
    through its key spectrum (:class:`qkgeom.monitor.EntropyController`, updated at every
    probe of the run); ``target`` None = off."""

    target: float | None = None  # H* in nats for every layer; None = no closed loop
    gain: float = 1.0  # change of log PR* per nat of error per probe
    max_step: float = 0.25  # bound on |Δ log PR*| per probe

    def __post_init__(self) -> None:
        _check_types(self, "entropy_control.")
        if self.target is not None and not (math.isfinite(self.target) and self.target >= 0):
            raise QKGeomError(f"entropy_control.target must be finite nats >= 0, got "
                              f"{self.target}")
        if not (self.gain > 0 and self.max_step > 0):
            raise QKGeomError("entropy_control.gain and max_step must be positive, got "
                              f"{self.gain} and {self.max_step}")

    @property
    def active(self) -> bool:
        return self.target is not None


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a run. ``seed`` fixes init and data order; the probe set
    is fixed by ``probe_seed``-independent data (the start of the val split), so every run of
    one experiment is probed on the same tokens."""

    model: GPTConfig = field(default_factory=GPTConfig)
    data: str = "sample"  # "sample" (the embedded Wikipedia text, cached) or a prepared folder
    seed: int = 0
    steps: int = 2000
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    probe_every: int = 100
    probe_sequences: int = 16
    probe_batch: int = 8
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    checkpoint_every: int = 250
    # "every": at each multiple of checkpoint_every (and the last step); "log": also at step
    # 0 and at steps 1, 2, 4, ... below checkpoint_every (Pythia's shape, for E4 families).
    checkpoint_schedule: str = "every"
    keep_checkpoints: int = 2  # the newest N are kept; 0 = keep all
    # The post-transient reference (docs/protocols.md): -1 = the first probe at or after 25 %
    # of the run's steps; an explicit step >= 0 wins.
    reference_step: int = -1
    # auto = bf16 autocast on CUDA, fp32 elsewhere (see effective_precision); bf16 and fp16
    # are opt-in anywhere. Weights and optimiser state stay fp32; probes run the fp32 model
    # and compute in float64.
    precision: str = "auto"
    # auto = CUDA, then MPS, then CPU (detect_device); the trainer records what it resolved
    # to. Not in the config hash: where a run computes is not what it computes.
    device: str = "auto"
    threads: int = 0  # 0 = leave torch's default
    compile: bool = False  # torch.compile the training forward/backward (probes stay eager)
    key_control: KeyControlConfig = field(default_factory=KeyControlConfig)
    entropy_control: EntropyControlConfig = field(default_factory=EntropyControlConfig)

    def __post_init__(self) -> None:
        # The nested sections validated themselves when they were built.
        for name, kind in (("model", GPTConfig), ("key_control", KeyControlConfig),
                           ("entropy_control", EntropyControlConfig)):
            if not isinstance(getattr(self, name), kind):
                raise QKGeomError(f"config key {name!r} must be a {kind.__name__}, got "
                                  f"{getattr(self, name)!r}")
        _check_types(self, "")
        positive = ("steps", "batch_size", "probe_every", "probe_sequences", "probe_batch",
                    "eval_every", "eval_batches", "log_every", "checkpoint_every")
        for name in positive:
            if getattr(self, name) <= 0:
                raise QKGeomError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.keep_checkpoints < 0:
            raise QKGeomError(f"keep_checkpoints must be >= 0 (0 = keep all), got "
                              f"{self.keep_checkpoints}")
        if self.checkpoint_schedule not in CHECKPOINT_SCHEDULES:
            raise QKGeomError(f"unknown checkpoint_schedule {self.checkpoint_schedule!r}; "
                              f"choose one of {', '.join(CHECKPOINT_SCHEDULES)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise QKGeomError(f"lr must be a positive finite number, got {self.lr}")
        if self.seed < 0:
            raise QKGeomError(f"seed must be >= 0, got {self.seed}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise QKGeomError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.warmup_steps > self.steps:
            raise QKGeomError(
                f"warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps}"
            )
        if not all(math.isfinite(v) and v >= 0 for v in (self.weight_decay, self.grad_clip)):
            raise QKGeomError("weight_decay and grad_clip must be finite and non-negative, got "
                              f"{self.weight_decay} and {self.grad_clip}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise QKGeomError("beta1 and beta2 must be in [0, 1)")
        if self.probe_every > self.steps:
            raise QKGeomError(
                f"probe_every ({self.probe_every}) is larger than steps ({self.steps}): "
                "the run would only be probed at its ends"
            )
        if self.precision not in PRECISIONS:
            raise QKGeomError(
                f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}"
            )
        if not 0 <= self.threads <= 4096:
            raise QKGeomError(f"threads must be in [0, 4096] (0 = torch's default), got "
                              f"{self.threads}")
        if self.reference_step < -1 or self.reference_step > self.steps:
            raise QKGeomError(f"reference_step must be -1 or in [0, steps], got {self.reference_step}")
        if not (self.device in ("auto", "cpu") or self.device.startswith(("cuda", "mps"))):
            raise QKGeomError(f"unknown device {self.device!r}; use {DEVICE_HELP}")
        controls = [n for n in ("key_control", "entropy_control") if getattr(self, n).active
                    and (n == "entropy_control" or self.key_control.mode != "none")]
        if self.model.qk_reparam != "none" and controls:
            raise QKGeomError(f"{controls[0]} reshapes W_K, which model.qk_reparam "
                              f"{self.model.qk_reparam!r} reparametrises; use one or the other")
        if len(controls) == 2:
            raise QKGeomError("key_control and entropy_control both reshape W_K; use one or "
                              "the other")

    def active_features(self) -> list[str]:
        """Config sections that ask for behaviour the trainer does not implement itself:
        each must be served by a callback (built from the config by :mod:`qkgeom.launch`)."""
        return [name for name in ("key_control", "entropy_control")
                if getattr(self, name).active]  # key_control: a control or its record

    @property
    def resolved_device(self) -> str:
        """The device a run of this config computes on here: ``auto`` resolved by
        :func:`detect_device` (which imports torch), any other name as given."""
        return detect_device() if self.device == "auto" else self.device

    @property
    def effective_precision(self) -> str:
        """The precision a run trains in: ``auto`` resolves by device, bf16 on CUDA (every GPU
        since Ampere computes bf16 natively; pass fp16 or fp32 on older ones) and fp32 on CPU
        and MPS, where bf16 is opt-in (fast only with AMX / AVX512-BF16 and large matmuls)."""
        if self.precision != "auto":
            return self.precision
        return "bf16" if self.resolved_device.startswith("cuda") else "fp32"

    @property
    def ref_step(self) -> int:
        """The post-transient reference step of this run (:meth:`ref_step_of`)."""
        return self.ref_step_of(self.steps, self.reference_step)

    @staticmethod
    def ref_step_of(steps: int, reference_step: int = -1) -> int:
        """The post-transient reference step of a run of ``steps``: ``reference_step`` when
        >= 0, else 25 % of the run, rounded up (so the first probe at or after it is the first
        at or after a quarter of the steps). Why 25 %, and not the end of warm-up or the PR
        minimum: docs/protocols.md. A function of the two numbers, for recorded configs."""
        return math.ceil(steps / 4) if reference_step < 0 else reference_step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """Stable short hash of everything that changes the result.

        Left out: ``device``, ``threads`` and ``compile`` (how fast, not what: a compiled
        step computes the same maths, to rounding, and a run may be resumed with or without
        it). In: the *effective* precision, since bf16 changes the numbers; ``auto`` hashes
        as what it resolves to, so ``auto`` on CPU and an explicit ``fp32`` are one run.
        """
        d = self.to_dict()
        for k in ("device", "threads", "compile"):
            d.pop(k)
        d["precision"] = self.effective_precision
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def detect_device() -> str:
    """What ``device: auto`` means on this machine: ``cuda`` when a CUDA device is
    visible, else ``mps`` (Apple GPUs), else ``cpu``. Imports torch (only here, so the
    config stays importable without it)."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def _check_types(cfg: Any, prefix: str) -> None:
    """Each scalar field has its default's type (an int where a float is wanted is fine):
    a config built in Python (``dataclasses.replace(cfg, steps="10")``) fails here, in one
    line, instead of as a TypeError deep in training."""
    for f in dataclasses.fields(cfg):
        if f.default is dataclasses.MISSING:  # the nested model config: validated itself
            continue
        value, kind = getattr(cfg, f.name), type(f.default)
        if f.default is None:  # an optional number: None = not given
            ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            what = "a number or null" if f.default is None else kind.__name__
            raise QKGeomError(f"config key {prefix + f.name!r} must be {what}, got {value!r}")


PRESETS: dict[str, dict[str, Any]] = {
    # Seconds on a laptop CPU: for tests and acceptance checks (>= 3 probe steps).
    "smoke": dict(
        model=dict(n_layer=2, n_head=2, n_embd=32, block_size=32),
        steps=40, batch_size=8, lr=3e-3, warmup_steps=5, probe_every=10, probe_sequences=4,
        probe_batch=4, eval_every=20, eval_batches=2, log_every=5, checkpoint_every=20,
    ),
    # The main job: the embedded sample, a small model, a few minutes on 2 CPU cores.
    "demo": dict(
        model=dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
        steps=2000, batch_size=32, lr=3e-3, warmup_steps=100, probe_every=100,
        probe_sequences=16, eval_every=250, eval_batches=8, checkpoint_every=500,
    ),
    # One GPU, WikiText-103 char level (depth comes from the grid; 6 is the middle one).
    # 64 x 256 tokens x 20k steps = 328 M tokens, about 0.6 epochs of WikiText-103 train.
    # Precision auto: bf16 on the GPU it is meant for (the same config hash as an explicit
    # bf16 there), fp32 where it lands on a CPU.
    "paper": dict(
        model=dict(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.0),
        steps=20000, batch_size=64, lr=1e-3, warmup_steps=1000, probe_every=500,
        probe_sequences=16, eval_every=1000, eval_batches=20, checkpoint_every=1000,
    ),
}


# --- nested mappings and dotted keys: the one set of helpers (config, grid, CLI) -----------


def deep_merge(base: dict[str, Any], over: dict[str, Any], *, strict: bool = False,
               prefix: str = "") -> dict[str, Any]:
    """``over`` on top of ``base``, recursing into nested mappings; neither is modified.
    ``strict`` (config overrides on the full defaults): a key ``base`` lacks is a one-line
    error with a "did you mean", and a section must stay a mapping."""
    out = dict(base)
    for key, value in over.items():
        name = f"{prefix}{key}"
        if strict and key not in base:
            raise QKGeomError(f"unknown config key {name!r}{_did_you_mean(key, base, prefix)}")
        if strict and isinstance(base[key], dict) and not isinstance(value, dict):
            raise QKGeomError(f"config key {name!r} must be a mapping (e.g. "
                              f"{name}.{next(iter(base[key]))}=...)")
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value, strict=strict, prefix=f"{name}.")
        else:
            out[key] = value
    return out


def nest_keys(d: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> nested mappings; a key set twice (``model.x`` and ``model: {x}``) fails."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if not isinstance(key, str) or not key:
            raise QKGeomError(f"{where}: keys must be non-empty strings, got {key!r}")
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise QKGeomError(f"{where}: {prefix + '.'.join(parts[:i + 1])!r} is set twice")
            node = child
        last = parts[-1]
        full = prefix + key
        if isinstance(value, dict):
            sub = nest_keys(value, where, full + ".")
            existing = node.setdefault(last, {})
            if not isinstance(existing, dict):
                raise QKGeomError(f"{where}: {full!r} is set twice")
            for k, v in sub.items():
                if k in existing:
                    raise QKGeomError(f"{where}: {full + '.' + k!r} is set twice")
                existing[k] = v
        else:
            if last in node:
                raise QKGeomError(f"{where}: {full!r} is set twice")
            node[last] = value
    return out


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> dotted keys (``{"model": {"n_layer": 4}}`` -> ``model.n_layer``)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _did_you_mean(key: Any, base: dict[str, Any], prefix: str) -> str:
    """``; did you mean 'model.n_layer'?`` for the closest keys, looking one level into
    the nested sections too (``depth`` -> ``model.n_layer`` is too far; ``n_layer`` at the
    top level finds it); ``""`` when nothing is close."""
    import difflib

    names = {k: prefix + k for k in base}
    for section, value in base.items():
        if isinstance(value, dict):
            names.update({k: f"{prefix}{section}.{k}" for k in value if k not in names})
    key = _SYNONYMS.get(str(key), str(key))
    close = [key] if key in names else difflib.get_close_matches(key, list(names), n=2,
                                                                 cutoff=0.7)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(names[c]) for c in close) + "?"


# Names other tools (and the CLI's flags) use for config keys, for "did you mean"; and the
# control's share before it was called dose.
_SYNONYMS = {"depth": "n_layer", "layers": "n_layer", "num_layers": "n_layer",
             "width": "n_embd", "d_model": "n_embd", "hidden_size": "n_embd",
             "heads": "n_head", "num_heads": "n_head", "context": "block_size",
             "seq_len": "block_size", "learning_rate": "lr", "max_steps": "steps",
             "shrink_to": "dose", "expand_to": "dose"}


def _coerce(value: Any, default: Any, name: str) -> Any:
    """Type-check one value against its default's type (ints may become floats; a default
    of None is an optional number)."""
    kind = type(default)
    if default is None:
        if value is None:
            return None
        kind = float
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is str and isinstance(value, str):
        return value
    what = "a number or null" if default is None else kind.__name__
    raise QKGeomError(f"config key {name!r} must be {what}, got {value!r}")


def _nested(cls: type) -> dict[str, type]:
    """The fields of ``cls`` that are themselves config dataclasses (``model``, ...)."""
    return {f.name: f.default_factory for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(f.default_factory)}


def _build(cls: type, full: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> Any:
    """``cls(**full)`` with each scalar coerced to its default's type, recursing into the
    nested config dataclasses."""
    nested = _nested(cls)
    kw = {}
    for key, value in full.items():
        if key in nested:
            kw[key] = _build(nested[key], value, defaults[key], f"{prefix}{key}.")
        else:
            kw[key] = _coerce(value, defaults[key], prefix + key)
    return cls(**kw)


def check_config_types(d: dict[str, Any], prefix: str = "") -> None:
    """QKGeomError unless every key of ``d`` that :class:`TrainConfig` knows holds a value of
    its type (as :func:`from_dict` would coerce it); unknown keys and values a newer rule
    would refuse are left alone. For readers of recorded configs (a report): a value of
    the wrong type (``"warmup_steps": "five"``) is one line, while a run recorded under
    older or newer rules still reads."""
    defaults = TrainConfig().to_dict()
    node = defaults
    for part in filter(None, prefix.rstrip(".").split(".")):
        node = node[part]
    for key, value in d.items():
        if key not in node:
            continue
        if isinstance(node[key], dict):
            if not isinstance(value, dict):
                raise QKGeomError(f"config key {prefix + key!r} must be a mapping, got "
                                  f"{value!r}")
            check_config_types(value, f"{prefix}{key}.")
        else:
            _coerce(value, node[key], prefix + key)


def from_dict(d: dict[str, Any]) -> TrainConfig:
    """Build a validated config from a (possibly partial) nested mapping."""
    if not isinstance(d, dict):
        raise QKGeomError("a config must be a mapping of keys to values")
    defaults = TrainConfig().to_dict()
    return _build(TrainConfig, deep_merge(defaults, d, strict=True), defaults)


#: A config or grid file is a few hundred bytes; these bound what a crafted one can cost
#: before it is refused (a 450-byte YAML alias bomb expands to gigabytes).
MAX_YAML_BYTES = 1 * 2**20
MAX_YAML_NODES = 20_000


def _yaml_loader() -> type:
    """The YAML loader of config and grid files: ``yaml.SafeLoader`` that refuses aliases
    (``*name``: each one can multiply what follows, the "billion laughs"), counts nodes
    (at most :data:`MAX_YAML_NODES`), reads ``1e-3`` as a float (YAML 1.2) and refuses a
    key given twice in one mapping. Built on first use, so the config imports no YAML."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        nodes = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.events.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None, None, "YAML aliases (*name) are not accepted in a config or grid "
                    "file: write the values out", event.start_mark)
            self.nodes += 1
            if self.nodes > MAX_YAML_NODES:
                raise yaml.composer.ComposerError(
                    None, None, f"more than {MAX_YAML_NODES:,} YAML nodes; a config or grid "
                    "file is far smaller", self.peek_event().start_mark)
            return super().compose_node(parent, index)

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    repeated = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: construct_mapping refuses it
                    continue
                if repeated:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice", node.start_mark)
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                        |[-+]?\.(?:inf|Inf|INF)
                        |\.(?:nan|NaN|NAN))$""", re.X),
        list("-+0123456789."),
    )
    _LOADER = Loader
    return Loader


_LOADER: type | None = None


def load_yaml_file(path: Any, what: str = "config file") -> Any:
    """A YAML (or JSON) config or grid file, parsed with :func:`_yaml_loader`'s limits; a
    missing, unreadable, oversized or invalid file is a one-line QKGeomError naming it."""
    from pathlib import Path

    import yaml

    path = Path(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_YAML_BYTES + 1)
    except FileNotFoundError:
        raise QKGeomError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise QKGeomError(f"{path}: is a folder, not a {what}") from None
    except OSError as err:
        raise QKGeomError(f"{path}: cannot read the {what} ({err.strerror})") from None
    if len(data) > MAX_YAML_BYTES:
        raise QKGeomError(f"{path}: larger than {MAX_YAML_BYTES // 2**20} MiB; a {what} is a "
                          "few hundred bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise QKGeomError(f"{path}: not UTF-8 text; a {what} is YAML or JSON") from None
    try:
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None)
        mark = getattr(err, "problem_mark", None)
        if problem:
            where = f", line {mark.line + 1}" if mark is not None else ""
            text = f"{' '.join(problem.split())}{where}"
        else:
            text = " ".join(" ".join(str(err).strip().splitlines()[:2]).split())
        raise QKGeomError(f"{path}: not valid YAML ({text[:240]})") from None
    except RecursionError:
        raise QKGeomError(f"{path}: not valid YAML (nested too deeply)") from None


def _scalar(raw: str) -> Any:
    """Parse a CLI value: int, then float (YAML 1.1 reads ``1e-3`` as a string), then YAML."""
    import yaml

    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def parse_dotted(overrides: list[str]) -> dict[str, Any]:
    """``["model.n_layer=6", "lr=1e-3"]`` -> nested dict (later wins); values parsed as YAML
    scalars."""
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise QKGeomError(f"override {item!r} must look like key=value (e.g. model.n_layer=6)")
        key, raw = item.split("=", 1)
        out = deep_merge(out, nest_keys({key.strip(): _scalar(raw)}, f"override {item!r}"))
    return out


def make_config(preset: str = "demo", overrides: dict[str, Any] | None = None) -> TrainConfig:
    """A preset with overrides applied on top (later wins), validated."""
    if preset not in PRESETS:
        raise QKGeomError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return from_dict(deep_merge(PRESETS[preset], overrides or {}))


def with_vocab(cfg: TrainConfig, vocab_size: int) -> TrainConfig:
    """The config with the model's vocabulary set from the prepared data."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
