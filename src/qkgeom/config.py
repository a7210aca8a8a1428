"""Frozen, typed run configuration: presets, overrides, validation, stable hash.

A run is fully described by one :class:`TrainConfig`, so a sweep can build, hash and
compare runs without globals. Each section validates itself in ``__post_init__`` (also
under ``dataclasses.replace``), once: an unknown key or impossible value is a one-line
:class:`~qkgeom.errors.QKGeomError` before any work, never a crash an hour into training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from qkgeom.errors import QKGeomError

QK_INITS = ("normal", "orthogonal", "tied")
# σReparam (γ·W/σ_max(W), docs/stability.md#remedies) of W_Q and W_K (qk) or of every
# linear layer of the blocks (all)
SIGMA_REPARAMS = ("none", "qk", "all")
QK_REPARAMS = ("none", "sigma")  # the old model.qk_reparam (sigma = sigma_reparam qk)
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
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
    qk_reparam: str = "none"  # old name: sigma is sigma_reparam qk (read as that, with a warning)
    sigma_reparam: str = "none"  # none | qk (W_Q, W_K) | all (every linear layer of the blocks)
    logit_softcap: float | None = None  # c of c·tanh(s/c) on the scaled logits; None: no cap
    qk_clip_threshold: float | None = None  # QK-Clip's τ on each head's max logit; None: off
    qk_clip_alpha: float = 0.5  # QK-Clip's α: W_Q rows × γ^α, W_K rows × γ^(1−α)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def __post_init__(self) -> None:
        _check_types(self, "model.")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            _check(getattr(self, name) > 0,
                   f"model.{name} must be a positive integer, got {getattr(self, name)}")
        _check(self.block_size >= 2, "model.block_size must be at least 2 (attention over one "
               f"position has no entropy to measure), got {self.block_size}")
        _check(not self.n_embd % self.n_head, f"model.n_embd ({self.n_embd}) must be divisible "
               f"by model.n_head ({self.n_head})")
        _check(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")
        _one_of("qk_init", self.qk_init, QK_INITS)
        _one_of("model.qk_reparam", self.qk_reparam, QK_REPARAMS)
        _one_of("model.sigma_reparam", self.sigma_reparam, SIGMA_REPARAMS)
        if self.qk_reparam == "sigma":  # the old name, read for one minor version
            _check(self.sigma_reparam in ("none", "qk"), "model.qk_reparam 'sigma' (the old "
                   "name of model.sigma_reparam: qk) contradicts model.sigma_reparam "
                   f"{self.sigma_reparam!r}; set model.sigma_reparam alone")
            warnings.warn("model.qk_reparam is renamed: use model.sigma_reparam: qk instead of "
                          "model.qk_reparam: sigma (the old name goes in the next minor "
                          "version)", FutureWarning, stacklevel=3)
            object.__setattr__(self, "qk_reparam", "none")
            object.__setattr__(self, "sigma_reparam", "qk")
        for name in ("logit_softcap", "qk_clip_threshold"):
            value = getattr(self, name)
            _check(value is None or (math.isfinite(value) and value > 0),
                   f"model.{name} must be a finite number > 0 (or null: off), got {value}")
        _check(math.isfinite(self.qk_clip_alpha) and 0.0 <= self.qk_clip_alpha <= 1.0,
               f"model.qk_clip_alpha must be in [0, 1], got {self.qk_clip_alpha}")
        if self.qk_clip_threshold is None:
            _check(self.qk_clip_alpha == 0.5, "model.qk_clip_alpha is read only by QK-Clip; "
                   "set model.qk_clip_threshold too (or leave the alpha unset)")
        else:
            _check(not self.qk_norm, "QK-Clip cannot act on a model with qk_norm: q and k are "
                   "normalised after the projections, so scaling W_Q and W_K does not move the "
                   "logits; use one or the other")
            _check(self.sigma_reparam == "none", "QK-Clip rescales the stored W_Q and W_K, but "
                   f"under model.sigma_reparam {self.sigma_reparam!r} the model uses γ·W/σ_max(W), "
                   "which that leaves unchanged; use one or the other")

    @property
    def qk_clip(self) -> bool:
        """Whether QK-Clip is on (``qk_clip_threshold`` set)."""
        return self.qk_clip_threshold is not None


@dataclass(frozen=True)
class KeyControlConfig:
    """Key-spectrum control during training (docs/definitions.md#key-spectrum-control).

    The one definition of the control's settings (:mod:`qkgeom.control` reads its allowed
    values here, so the config stays torch-free). ``dose`` None is replaced by the mode's
    :attr:`DEFAULT_DOSE` when built, so an explicit default and an omitted one are one run."""

    MODES = ("none", "hold", "shrink", "sham", "expand")
    LEVELS = ("token", "weight")
    SCALES = ("data", "frobenius")
    SCOPES = ("layer", "head")
    HOWS = ("post_step", "parametrize")
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
            _one_of(prefix + name, getattr(self, name), allowed)
        mode, dose = self.mode, self.dose
        if mode in ("hold", "none"):
            _check(dose is None, f"{prefix}dose is not used by {mode}; got {dose} (leave it "
                   "unset)")
        else:
            _check(math.isfinite(dose), f"{prefix}dose must be a finite number, got {dose}")
            _check(dose > 0, f"{prefix}dose must be > 0, got {dose} (leave it unset for the "
                   "mode's default)")
        _check(mode != "shrink" or 0.0 < dose <= 1.0,
               f"{prefix}dose must be in (0, 1] for shrink, got {dose}")
        _check(mode != "expand" or dose >= 1.0, f"{prefix}dose must be >= 1 for expand, got {dose}")
        _check(mode != "sham" or dose == 1.0, f"{prefix}dose is fixed at 1 for sham; got {dose} "
               "(leave it unset)")
        _check(not self.reference or mode in self.CAPPED or (mode != "none" and self.scale == "data"),
               f"{prefix}reference is read by {', '.join(self.CAPPED)} (a cap relative to a "
               "reference run) and by the data scale rule (the key spread matched to it); "
               f"{mode} with the {self.scale} rule reads nothing from it")
        _check(self.ramp_steps >= -1, f"{prefix}ramp_steps must be -1 (= warmup_steps) or >= 0, "
               f"got {self.ramp_steps}")

    @property
    def active(self) -> bool:
        """Whether a callback must serve this section: a control, or only the recording."""
        return self.mode != "none" or self.record

    @property
    def arm(self) -> str:
        """The E3 arm this section is: ``none``, ``hold-<level>-<scale>``,
        ``shrink-<dose>-<level>-<scale>``, ... (docs/definitions.md#e3-arms)."""
        if self.mode == "none":
            return "none"
        if self.mode in ("hold", "sham"):
            return f"{self.mode}-{self.level}-{self.scale}"
        return f"{self.mode}-{float(self.dose):g}-{self.level}-{self.scale}"

    @classmethod
    def arm_settings(cls, name: str) -> dict[str, Any]:
        """The ``key_control`` keys of the E3 arm ``name`` (the inverse of :attr:`arm`); a
        one-line QKGeomError for a name that is not an arm."""
        if name == "none":
            return {"mode": "none"}
        parts = name.split("-")
        if len(parts) >= 3 and parts[-2] in cls.LEVELS and parts[-1] in cls.SCALES:
            out: dict[str, Any] = {"mode": parts[0], "level": parts[-2], "scale": parts[-1]}
            if parts[0] in ("hold", "sham") and len(parts) == 3:
                return out
            if parts[0] in ("shrink", "expand") and len(parts) == 4:
                with contextlib.suppress(ValueError):
                    return {**out, "dose": float(parts[1])}
        raise QKGeomError(f"unknown E3 arm {name!r}; arms are none, sham-<level>-<scale>, "
                          "hold-<level>-<scale>, shrink-<dose>-<level>-<scale>, "
                          f"expand-<dose>-<level>-<scale> with level {' or '.join(cls.LEVELS)}"
                          f" and scale {' or '.join(cls.SCALES)}")


@dataclass(frozen=True)
class EntropyControlConfig:
    """The closed loop steering each layer's attention entropy toward ``target`` nats
    through its key spectrum (:class:`qkgeom.control.closed_loop.EntropyController`); None =
    off."""

    target: float | None = None  # H* in nats for every layer; None = no closed loop
    gain: float = 1.0  # change of log PR* per nat of error per probe
    max_step: float = 0.25  # bound on |Δ log PR*| per probe

    def __post_init__(self) -> None:
        _check_types(self, "entropy_control.")
        _check(self.target is None or (math.isfinite(self.target) and self.target >= 0),
               f"entropy_control.target must be finite nats >= 0, got {self.target}")
        _check(self.gain > 0 and self.max_step > 0, "entropy_control.gain and max_step must be "
               f"positive, got {self.gain} and {self.max_step}")

    @property
    def active(self) -> bool:
        return self.target is not None


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a run. ``seed`` fixes init and data order; every run is
    probed on the same tokens (the start of the val split)."""

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
    checkpoint_schedule: str = "every"  # log: also step 0 and 1, 2, 4, ... below it (E4)
    keep_checkpoints: int = 2  # the newest N are kept; 0 = keep all
    reference_step: int = -1  # -1 = 25 % of the steps (ref_step_of)
    precision: str = "auto"  # the forward's autocast (effective_precision); probes: float64
    device: str = "auto"  # not in the config hash: where a run computes is not what
    threads: int = 0  # 0 = leave torch's default
    compile: bool = False  # torch.compile the training forward/backward (probes stay eager)
    key_control: KeyControlConfig = field(default_factory=KeyControlConfig)
    entropy_control: EntropyControlConfig = field(default_factory=EntropyControlConfig)
    z_loss: float = 0.0  # coefficient of mean (log Z)² added to the training objective (PaLM)

    def __post_init__(self) -> None:
        for name, kind in _SECTIONS.items():
            if not isinstance(getattr(self, name), kind):
                raise QKGeomError(f"config key {name!r} must be a {kind.__name__}, got "
                                  f"{getattr(self, name)!r}")
        _check_types(self, "")
        positive = ("steps", "batch_size", "probe_every", "probe_sequences", "probe_batch",
                    "eval_every", "eval_batches", "log_every", "checkpoint_every")
        for name in positive:
            _check(getattr(self, name) > 0,
                   f"{name} must be a positive integer, got {getattr(self, name)}")
        _check(self.keep_checkpoints >= 0,
               f"keep_checkpoints must be >= 0 (0 = keep all), got {self.keep_checkpoints}")
        _one_of("checkpoint_schedule", self.checkpoint_schedule, CHECKPOINT_SCHEDULES)
        _check(math.isfinite(self.lr) and self.lr > 0,
               f"lr must be a positive finite number, got {self.lr}")
        _check(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        _check(0.0 <= self.min_lr_ratio <= 1.0,
               f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _check(0 <= self.warmup_steps <= self.steps,
               f"warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps}")
        _check(all(math.isfinite(v) and v >= 0 for v in (self.weight_decay, self.grad_clip)),
               "weight_decay and grad_clip must be finite and non-negative, got "
               f"{self.weight_decay} and {self.grad_clip}")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "beta1 and beta2 must be in [0, 1)")
        _check(self.probe_every <= self.steps, f"probe_every ({self.probe_every}) is larger "
               f"than steps ({self.steps}): the run would only be probed at its ends")
        _one_of("precision", self.precision, PRECISIONS)
        _check(0 <= self.threads <= 4096,
               f"threads must be in [0, 4096] (0 = torch's default), got {self.threads}")
        _check(-1 <= self.reference_step <= self.steps,
               f"reference_step must be -1 or in [0, steps], got {self.reference_step}")
        _check(self.device in ("auto", "cpu") or self.device.startswith(("cuda", "mps")),
               f"unknown device {self.device!r}; use {DEVICE_HELP}")
        _check(math.isfinite(self.z_loss) and self.z_loss >= 0,
               f"z_loss must be a finite number >= 0 (0: off), got {self.z_loss}")
        controls = [n for n in ("key_control", "entropy_control") if getattr(self, n).active
                    and (n == "entropy_control" or self.key_control.mode != "none")]
        _check(self.model.sigma_reparam == "none" or not controls,
               f"{controls[0] if controls else ''} reshapes W_K, which model.sigma_reparam "
               f"{self.model.sigma_reparam!r} reparametrises; use one or the other")
        _check(not self.model.qk_clip or not controls,
               f"{controls[0] if controls else ''} reshapes W_K, which QK-Clip "
               "(model.qk_clip_threshold) rescales after every step too; use one or the other")
        _check(len(controls) < 2,
               "key_control and entropy_control both reshape W_K; use one or the other")

    def active_features(self) -> list[str]:
        """Config sections (and ``qk_clip``) each of which a callback must serve
        (:mod:`qkgeom.launch` builds them)."""
        return [name for name in ("key_control", "entropy_control")
                if getattr(self, name).active] + (  # key_control: a control or its record
                    ["qk_clip"] if self.model.qk_clip else [])

    @property
    def effective_precision(self) -> str:
        """The precision a run trains in: ``auto`` is bf16 on CUDA (native since Ampere) and
        fp32 on CPU and MPS, where bf16 is opt-in (docs/speed.md#settings)."""
        if self.precision != "auto":
            return self.precision
        device = detect_device() if self.device == "auto" else self.device
        return "bf16" if device.startswith("cuda") else "fp32"

    @property
    def ref_step(self) -> int:
        """The post-transient reference step of this run (:meth:`ref_step_of`)."""
        return self.ref_step_of(self.steps, self.reference_step)

    @staticmethod
    def ref_step_of(steps: int, reference_step: int = -1) -> int:
        """The post-transient reference step of a run of ``steps``: ``reference_step`` when
        >= 0, else 25 % of the run rounded up (why: docs/protocols.md). For recorded configs
        too."""
        return math.ceil(steps / 4) if reference_step < 0 else reference_step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """Stable short hash of everything that changes the result: not ``device``, ``threads`` or
        ``compile`` (how fast, not what), and the *effective* precision (``auto`` on CPU and
        ``fp32`` are one run). Keys added after a run was recorded are left out at their
        defaults, and ``sigma_reparam: qk`` is hashed as its old name ``qk_reparam: sigma``, so
        every earlier run keeps its hash (tests/test_config_hash.py)."""
        d = self.to_dict()
        for k in ("device", "threads", "compile"):
            d.pop(k)
        d["precision"] = self.effective_precision
        for section, defaults in _ADDED_KEYS.items():
            node = d[section] if section else d
            for k, default in defaults.items():
                if node[k] == default:
                    node.pop(k)
        if d["model"].get("sigma_reparam") == "qk":
            d["model"].pop("sigma_reparam")
            d["model"]["qk_reparam"] = "sigma"
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


#: Keys added after runs were recorded, with their defaults: left out of the config hash
#: while at them (section "" is the top level).
_ADDED_KEYS: dict[str, dict[str, Any]] = {
    "model": {"sigma_reparam": "none", "logit_softcap": None, "qk_clip_threshold": None,
              "qk_clip_alpha": 0.5},
    "": {"z_loss": 0.0},
}

#: The config sections: key -> their dataclass.
_SECTIONS: dict[str, type] = {"model": GPTConfig, "key_control": KeyControlConfig,
                              "entropy_control": EntropyControlConfig}


def detect_device() -> str:
    """What ``device: auto`` means here: ``cuda``, else ``mps``, else ``cpu`` (imports
    torch)."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise QKGeomError(message)


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")


def _check_types(cfg: Any, prefix: str) -> None:
    """Each scalar field has its default's type (an int where a float is wanted is fine):
    a config built in Python (``dataclasses.replace(cfg, steps="10")``) fails here, in one
    line, instead of as a TypeError deep in training."""
    for f in dataclasses.fields(cfg):
        if f.default is not dataclasses.MISSING and not _of_type(getattr(cfg, f.name), f.default):
            raise _type_error(prefix + f.name, f.default, getattr(cfg, f.name))


def _of_type(value: Any, default: Any) -> bool:
    """Whether ``value`` has ``default``'s type: an int is a float too, a bool never a
    number, and a default of None means an optional number."""
    if default is None:
        return value is None or _of_type(value, 0.0)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type(default) is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, type(default))


def _type_error(name: str, default: Any, value: Any) -> QKGeomError:
    what = "a number or null" if default is None else type(default).__name__
    return QKGeomError(f"config key {name!r} must be {what}, got {value!r}")


def _coerce(value: Any, default: Any, name: str) -> Any:
    """``value`` checked against its default's type (:func:`_of_type`), a number made a
    float where a float is wanted and a whole float an int where an int is."""
    if _of_type(value, default):
        numeric = default is None or isinstance(default, float)
        return float(value) if numeric and value is not None else value
    if type(default) is int and isinstance(value, float) and value.is_integer():
        return int(value)
    raise _type_error(name, default, value)


PRESETS: dict[str, dict[str, Any]] = {
    # Seconds on a CPU: tests and acceptance checks (>= 3 probe steps).
    "smoke": dict(
        model=dict(n_layer=2, n_head=2, n_embd=32, block_size=32),
        steps=40, batch_size=8, lr=3e-3, warmup_steps=5, probe_every=10, probe_sequences=4,
        probe_batch=4, eval_every=20, eval_batches=2, log_every=5, checkpoint_every=20,
    ),
    # The main job: the embedded sample, a small model, a few minutes on 2 CPU cores.
    # Named for its size: the experiments' sizes (smoke/demo/lab) are their own presets.
    "small": dict(
        model=dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
        steps=2000, batch_size=32, lr=3e-3, warmup_steps=100, probe_every=100,
        probe_sequences=16, eval_every=250, eval_batches=8, checkpoint_every=500,
    ),
    # One GPU, WikiText-103 char level, bf16 there (docs/training.md: why this size).
    "paper": dict(
        model=dict(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.0),
        steps=20000, batch_size=64, lr=1e-3, warmup_steps=1000, probe_every=500,
        probe_sequences=16, eval_every=1000, eval_batches=20, checkpoint_every=1000,
    ),
}


# --- nested mappings and dotted keys: the one set of helpers (config, grid, CLI) -----------


def deep_merge(base: dict[str, Any], over: dict[str, Any], *, strict: bool = False,
               prefix: str = "") -> dict[str, Any]:
    """``over`` on top of ``base``, recursing into mappings; neither is modified. ``strict``
    (overrides on the full defaults): an unknown key is a one-line error with a "did you
    mean", and a section must stay a mapping."""
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
    """``; did you mean 'model.n_layer'?`` for the closest keys, one level into the sections
    too; ``""`` when nothing is close."""
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


# Names other tools (and the CLI's flags) use for config keys, for "did you mean".
_SYNONYMS = {"depth": "n_layer", "layers": "n_layer", "num_layers": "n_layer",
             "width": "n_embd", "d_model": "n_embd", "hidden_size": "n_embd",
             "heads": "n_head", "num_heads": "n_head", "context": "block_size",
             "seq_len": "block_size", "learning_rate": "lr", "max_steps": "steps",
             "shrink_to": "dose", "expand_to": "dose"}


def _coerced(d: dict[str, Any], node: dict[str, Any], prefix: str = "",
             build: bool = False) -> dict[str, Any]:
    """The keys of ``d`` that the defaults ``node`` know, each value checked against its
    default's type (:func:`_coerce`), recursing into the sections (``build``: each one made
    its config dataclass, in field order, so it validates where it always has)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if key not in node:
            continue
        if isinstance(node[key], dict):
            if not isinstance(value, dict):
                raise QKGeomError(f"config key {prefix + key!r} must be a mapping, got "
                                  f"{value!r}")
            out[key] = _coerced(value, node[key], f"{prefix}{key}.")
            if build:
                out[key] = _SECTIONS[key](**out[key])
        else:
            out[key] = _coerce(value, node[key], prefix + key)
    return out


def check_config_types(d: dict[str, Any]) -> None:
    """QKGeomError unless every key of ``d`` that :class:`TrainConfig` knows holds a value
    of its type. For readers of recorded configs: unknown keys and values newer rules would
    refuse are left alone, so a run recorded under other rules still reads."""
    _coerced(d, TrainConfig().to_dict())


def from_dict(d: dict[str, Any]) -> TrainConfig:
    """Build a validated config from a (possibly partial) nested mapping."""
    if not isinstance(d, dict):
        raise QKGeomError("a config must be a mapping of keys to values")
    defaults = TrainConfig().to_dict()
    return TrainConfig(**_coerced(deep_merge(defaults, d, strict=True), defaults, build=True))


#: A config or grid file is a few hundred bytes; these bound what a crafted one can cost
#: before it is refused (docs/faults.md#untrusted-files).
MAX_YAML_BYTES = 1 * 2**20
MAX_YAML_NODES = 20_000


@functools.cache
def _yaml_loader() -> type:
    """``yaml.SafeLoader`` that refuses aliases (each can multiply what follows) and a key given
    twice, counts nodes and reads ``1e-3`` as a float (YAML 1.2); docs/faults.md#bad-input."""
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
    return Loader


def load_yaml_file(path: Any, what: str = "config file") -> Any:
    """A YAML (or JSON) config or grid file within :func:`_yaml_loader`'s limits; a missing,
    unreadable, oversized or invalid file is a one-line QKGeomError naming it."""
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


def make_config(preset: str = "small", overrides: dict[str, Any] | None = None) -> TrainConfig:
    """A preset with overrides applied on top (later wins), validated."""
    if preset not in PRESETS:
        raise QKGeomError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return from_dict(deep_merge(PRESETS[preset], overrides or {}))


def with_vocab(cfg: TrainConfig, vocab_size: int) -> TrainConfig:
    """The config with the model's vocabulary set from the prepared data."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
