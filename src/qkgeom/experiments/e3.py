"""E3: seeds x named key-control arms, paired by seed.

Arms (:attr:`qkgeom.config.KeyControlConfig.arm`, the one home of arm names both ways):
``none`` (no control; records its per-step PR_K and key spread, the reference),
``sham-<level>-<scale>``, ``hold-<level>-<scale>`` and ``shrink-<dose>-<level>-<scale>``.
A controlled arm that reads the ``none`` run of its seed (a cap relative to its PR_K, or
the data rule's matched key spread) depends on it, so the runner trains that run first.
The seed is the outer axis and ``none`` the first arm, so a sweep finishes whole seeds
first and a partial sweep already has complete pairs. Sizes (seed counts from the power
calculation of docs/protocols.md#e3):

``smoke``  2 seeds x the four core arms (none, sham, hold, shrink-0.5; token level, data rule).
``demo``   20 seeds x the core arms on the E1 demo's 4-layer model (normal init), probed every
           25 steps.
``lab``    8 seeds x the core arms, 2 000 steps (fewer seeds than the power calculation asks
           for, said in its report).
``paper``  20 seeds x 8 arms (the core arms; shrink at doses 0.75 and 0.25; hold and
           shrink-0.5 at the weight level with the Frobenius rule) on WikiText-103.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qkgeom.config import KeyControlConfig, deep_merge
from qkgeom.experiments.e1 import DEMO_RUN, LAB_RUN
from qkgeom.experiments.experiment import Experiment

#: The arms every E3 size has: the primary rows of docs/protocols.md#e3 read them.
E3_CORE_ARMS = ["none", "sham-token-data", "hold-token-data", "shrink-0.5-token-data"]
_FOUR_LAYERS = {"model": {"n_layer": 4, "qk_init": "normal"}}


@dataclass(frozen=True)
class E3Preset:
    """One size of E3: the training preset, the overrides every run gets, the seeds and
    the arms."""

    train_preset: str
    overrides: dict[str, Any]
    seeds: list[int]
    arms: list[str]


E3_PRESETS: dict[str, E3Preset] = {
    "smoke": E3Preset("smoke", {}, [0, 1], E3_CORE_ARMS),
    "demo": E3Preset("demo", deep_merge(DEMO_RUN, {**_FOUR_LAYERS, "probe_every": 25}),
                     list(range(20)), E3_CORE_ARMS),
    "lab": E3Preset("demo", deep_merge(LAB_RUN, _FOUR_LAYERS), list(range(8)), E3_CORE_ARMS),
    "paper": E3Preset("paper", {"model": {"n_layer": 6, "qk_init": "normal"}}, list(range(20)),
                      [*E3_CORE_ARMS, "shrink-0.75-token-data", "shrink-0.25-token-data",
                       "hold-weight-frobenius", "shrink-0.5-weight-frobenius"]),
}


def e3_arm(name: str) -> dict[str, Any]:
    """The E3 arm called ``name`` as a grid arm (docs/definitions.md#e3-arms): the settings
    its name gives, and ``reference: none`` when it reads the ``none`` run of its seed."""
    settings = KeyControlConfig.arm_settings(name)
    if name == "none":
        return {"name": name, "set": {"key_control.mode": "none", "key_control.record": True}}
    arm = {"name": name, "set": {f"key_control.{k}": v for k, v in settings.items()}}
    if settings["mode"] in KeyControlConfig.CAPPED or settings["scale"] == "data":
        arm["reference"] = "none"
    return arm


class E3(Experiment):
    name = "e3"
    presets = E3_PRESETS

    def grid_dict(self, spec: E3Preset) -> dict[str, Any]:
        return {"axes": {"seed": list(spec.seeds)}, "arms": [e3_arm(a) for a in spec.arms]}
