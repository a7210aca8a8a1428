"""Stability: attention-entropy collapse at small scale, the remedies on a learning-rate
sweep, and the alert calibration across model sizes.

Learning rates x seeds x remedies (the arms) on the demo model, paired by seed (a remedy's
run starts from the same initial weights and sees the same batches as the seed's ``none``
run). ``calibrate`` and ``transfer`` train ``none`` on several model sizes in one sweep
(the grid's sizes, paired within a size). The protocol (collapse, claims, alert
calibration), the remedies and the sizes are docs/stability.md, fixed before any run.
"""

from __future__ import annotations

import warnings
from typing import Any

from qkgeom.analysis.stability.outcomes import STABLE_LR
from qkgeom.errors import QKGeomError
from qkgeom.experiments.experiment import Experiment, Preset

#: Remedy name -> the config keys its runs set (docs/stability.md#remedies).
REMEDIES: dict[str, dict[str, Any]] = {
    "none": {"key_control.mode": "none"},
    "qk_norm": {"model.qk_norm": True},
    "sigma_reparam_qk": {"model.sigma_reparam": "qk"},
    "sigma_reparam_all": {"model.sigma_reparam": "all"},
    "qk_clip": {"model.qk_clip_threshold": 100.0, "model.qk_clip_alpha": 0.5},
    "logit_softcap": {"model.logit_softcap": 50.0},
    "z_loss": {"z_loss": 1.0e-4},
    "hold": {"key_control.mode": "hold", "key_control.level": "token",
             "key_control.scale": "data"},
    "entropy_target": {"entropy_control.target": 2.0},
}
#: Old arm name -> its new name (kept one minor version, with a warning).
RENAMED_ARMS = {"sigma_reparam": "sigma_reparam_qk"}
#: The lab drops the two key controls (protocol 1's lab: the hold diverged in 32/32 runs,
#: the closed loop prevented no collapse); both stay in the demo.
LAB_ARMS = [a for a in REMEDIES if a not in ("hold", "entropy_target")]

DEMO_LRS = [3e-4, STABLE_LR, 3e-2, 3e-1]  # a decade apart
LAB_LRS = [3e-4, 1e-3, STABLE_LR, 1e-2, 3e-2, 1e-1, 3e-1]  # half a decade apart
ALERT_LRS = [STABLE_LR, 3e-2, 1e-1]  # calibrate and transfer


def _size(n_layer: int, n_head: int, n_embd: int, block_size: int,
          batch_size: int) -> dict[str, Any]:
    """One model size at 1 024 training tokens per step (batch × context)."""
    return {"model.n_layer": n_layer, "model.n_head": n_head, "model.n_embd": n_embd,
            "model.block_size": block_size, "batch_size": batch_size}


#: Calibration sizes: widths 64/128/256 (head dim 16/32/64) at context 64, width 128 at 256.
CALIBRATION_SIZES = {
    "4x64-ctx64": _size(4, 4, 64, 64, 16),
    "4x128-ctx64": _size(4, 4, 128, 64, 16),
    "4x256-ctx64": _size(4, 4, 256, 64, 16),
    "4x128-ctx256": _size(4, 4, 128, 256, 4),
}
#: Held-out sizes no calibration run used (head dim 32 and 48, contexts 128 and 32).
TRANSFER_SIZES = {
    "6x192-ctx128": _size(6, 6, 192, 128, 8),
    "2x96-ctx32": _size(2, 2, 96, 32, 32),
}

_DEMO_MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "qk_init": "normal"}
_DEMO_RUN: dict[str, Any] = {
    "model": _DEMO_MODEL, "steps": 200, "batch_size": 16, "warmup_steps": 20,
    "probe_every": 5, "eval_every": 10, "eval_batches": 4, "log_every": 10,
    "checkpoint_every": 100,
}
_LAB_RUN: dict[str, Any] = {**_DEMO_RUN, "steps": 500, "warmup_steps": 50, "probe_every": 10,
                            "eval_every": 10, "checkpoint_every": 250}
_SMOKE_RUN: dict[str, Any] = {"steps": 40, "probe_every": 5, "eval_every": 5,
                              "checkpoint_every": 20}

#: Each size: learning rates x seeds x remedies (the arms), and the model sizes.
STABILITY_PRESETS: dict[str, Preset] = {
    "smoke": Preset("smoke", _SMOKE_RUN, [0], {"lr": [STABLE_LR, 1e-1]}, list(REMEDIES)),
    "demo": Preset("small", _DEMO_RUN, list(range(5)), {"lr": DEMO_LRS}, list(REMEDIES)),
    "lab": Preset("small", _LAB_RUN, list(range(5)), {"lr": LAB_LRS}, LAB_ARMS),
    "calibrate": Preset("small", _DEMO_RUN, [100, 101, 102], {"lr": ALERT_LRS}, ["none"],
                        CALIBRATION_SIZES),
    "transfer": Preset("small", _DEMO_RUN, [200, 201, 202], {"lr": ALERT_LRS}, ["none"],
                       TRANSFER_SIZES),
}


class Stability(Experiment):
    name = "stability"
    presets = STABILITY_PRESETS

    def arm(self, name: str) -> dict[str, Any]:
        """The arm of remedy ``name`` (an old name: its new one, with a warning)."""
        if name in RENAMED_ARMS:
            new = RENAMED_ARMS[name]
            warnings.warn(f"stability arm {name!r} is now {new!r}; the old name goes in the "
                          "next minor version", FutureWarning, stacklevel=2)
            name = new
        if name not in REMEDIES:
            raise QKGeomError(f"unknown stability remedy {name!r}; choose one of "
                              f"{', '.join(REMEDIES)}")
        return {"name": name, "set": dict(REMEDIES[name])}
