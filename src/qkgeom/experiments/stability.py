"""Stability: attention-entropy collapse at small scale, and the remedies on equal terms.

Learning rates x seeds x remedies (the arms) on the demo model, paired by seed (a remedy's
run starts from the same initial weights and sees the same batches as the seed's ``none``
run). The protocol (collapse, claims, alert calibration), the remedies and the sizes are
docs/stability.md, fixed before any run.
"""

from __future__ import annotations

from typing import Any

from qkgeom.experiments.experiment import Experiment, Preset

#: Remedy name -> the config keys its runs set (docs/stability.md#remedies).
REMEDIES: dict[str, dict[str, Any]] = {
    "none": {"key_control.mode": "none"},
    "qk_norm": {"model.qk_norm": True},
    "sigma_reparam": {"model.qk_reparam": "sigma"},
    "hold": {"key_control.mode": "hold", "key_control.level": "token",
             "key_control.scale": "data"},
    "entropy_target": {"entropy_control.target": 2.0},
}
STABLE_LR = 3e-3  # the small training preset's lr: the runs every departure is measured from

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

#: Each size: learning rates x seeds x remedies (the arms).
STABILITY_PRESETS: dict[str, Preset] = {
    "smoke": Preset("smoke", _SMOKE_RUN, [0], {"lr": [STABLE_LR, 1e-1]}, list(REMEDIES)),
    "demo": Preset("small", _DEMO_RUN, list(range(5)), {"lr": [STABLE_LR, 3e-2]}, list(REMEDIES)),
    "lab": Preset("small", _LAB_RUN, list(range(8)), {"lr": [STABLE_LR, 1e-2, 3e-2, 1e-1]},
                  list(REMEDIES)),
    "calibrate": Preset("small", _DEMO_RUN, [100, 101, 102], {"lr": [STABLE_LR, 3e-2]}, ["none"]),
}


class Stability(Experiment):
    name = "stability"
    presets = STABILITY_PRESETS

    def arm(self, name: str) -> dict[str, Any]:
        return {"name": name, "set": dict(REMEDIES[name])}
