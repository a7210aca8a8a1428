"""E3: seeds x named key-control arms, paired by seed.

Arm names both ways live in :attr:`qkgeom.config.KeyControlConfig.arm`. A controlled arm
that reads the ``none`` run of its seed depends on it, so the runner trains that first; the
seed is the outer axis and ``none`` the first arm, so a partial sweep already has complete
pairs. Sizes and arms: docs/definitions.md#e3-arms (seed counts:
docs/protocols.md#power-and-seeds).
"""

from __future__ import annotations

from typing import Any

from qkgeom.config import KeyControlConfig, deep_merge
from qkgeom.experiments.e1 import DEMO_RUN, LAB_RUN
from qkgeom.experiments.experiment import Experiment, Preset

#: The arms every E3 size has: the primary rows of docs/protocols.md#e3 read them.
E3_CORE_ARMS = ["none", "sham-token-data", "hold-token-data", "shrink-0.5-token-data"]
#: E3 at a second width: the primary rows' arms, no sham (docs/protocols.md#sizes-demo-and-lab).
E3_WIDTH_ARMS = ["none", "shrink-0.5-token-data", "hold-token-data"]
_FOUR_LAYERS = {"model": {"n_layer": 4, "qk_init": "normal"}}
#: The demo's model at width 64: 4 heads of dimension 16, context 64.
_WIDTH_64 = {"model": {"n_layer": 4, "qk_init": "normal", "n_embd": 64, "n_head": 4,
                       "block_size": 64}}


E3_PRESETS: dict[str, Preset] = {
    "smoke": Preset("smoke", {}, [0, 1], arms=E3_CORE_ARMS),
    "demo": Preset("small", deep_merge(DEMO_RUN, {**_FOUR_LAYERS, "probe_every": 25}),
                   list(range(20)), arms=E3_CORE_ARMS),
    "lab": Preset("small", deep_merge(LAB_RUN, _FOUR_LAYERS), list(range(8)), arms=E3_CORE_ARMS),
    "w64": Preset("small", deep_merge(DEMO_RUN, {**_WIDTH_64, "probe_every": 25}),
                  list(range(20)), arms=E3_WIDTH_ARMS),
    "paper": Preset("paper", {"model": {"n_layer": 6, "qk_init": "normal"}}, list(range(20)),
                    arms=[*E3_CORE_ARMS, "shrink-0.75-token-data", "shrink-0.25-token-data",
                          "hold-weight-frobenius", "shrink-0.5-weight-frobenius"]),
}


def e3_arm(name: str) -> dict[str, Any]:
    """The E3 arm ``name`` as a grid arm: the settings its name gives, and ``reference:
    none`` when it reads the ``none`` run of its seed."""
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
    arm = staticmethod(e3_arm)
