"""E1 and E2: depths x Q/K inits x replicates, every run with its own seed; and the width
ladder, seeds x named settings (widths, and two arms at width 128).

``distinct_seeds``: runs sharing a seed would share their data order and, within a depth,
every initial weight but W_Q/W_K, so they would not be independent units. E2's claims are
measured on the same runs. The ladder's settings are grid arms, so seed s trains at every
width (its runs differ by width only, the per-seed trend's pairing) while the runs of one
width keep distinct seeds. Sizes: docs/definitions.md#e1-and-e2, docs/protocols.md#sizes-demo-and-lab.
"""

from __future__ import annotations

from typing import Any

from qkgeom.config import QK_INITS
from qkgeom.errors import QKGeomError
from qkgeom.experiments.experiment import Experiment, Preset

PAPER_DEPTHS = [4, 6, 8]


def _e1(train_preset: str, overrides: dict[str, Any], depths: list[int],
        seeds: list[int]) -> Preset:
    """One size of E1: depths x every Q/K init x replicates."""
    return Preset(train_preset, overrides, seeds,
                  {"model.n_layer": depths, "model.qk_init": list(QK_INITS)})


#: The demo size's model (the small training preset's, depth set per run) and schedule,
#: shared by E1's and E3's demo and lab sizes.
DEMO_RUN: dict[str, Any] = {
    "model": {"n_head": 4, "n_embd": 128, "block_size": 64},
    "steps": 400, "batch_size": 16, "warmup_steps": 30, "probe_every": 40,
    "eval_every": 100, "eval_batches": 4, "checkpoint_every": 100,
}
#: The lab size: the demo run 5x longer, probed and evaluated less often.
LAB_RUN: dict[str, Any] = {**DEMO_RUN, "steps": 2000, "probe_every": 100, "eval_every": 250,
                           "checkpoint_every": 500}

#: The width ladder's run: the lab's depth-4 normal-init configuration (its evaluation and
#: checkpoints too), probed every 200 steps (the demo's ten probe intervals over 2 000).
LADDER_RUN: dict[str, Any] = {**LAB_RUN, "probe_every": 200,
                              "model": {**LAB_RUN["model"], "n_layer": 4, "qk_init": "normal"}}
LADDER_WIDTHS = [64, 128, 256]  # 4 heads: head dimension 16, 32, 64
#: 8: the fewest whose two-sided sign-flip p, Holm-adjusted over six trend rows, can fall
#: below 0.05 (docs/protocols.md#settings-and-seeds).
LADDER_SEEDS = list(range(8))
#: The ladder's settings by arm name (dotted overrides of :data:`LADDER_RUN`): a rung per
#: width, then arms at width 128 compared with its rung (docs/protocols.md#the-width-ladder).
#: ``w128-ctx256`` is defined but not in the preset: the time it would add (same page).
LADDER_ARMS: dict[str, dict[str, Any]] = {
    **{f"w{w}": {"model.n_embd": w} for w in LADDER_WIDTHS},
    "w128-tokens4x": {"model.n_embd": 128, "batch_size": 32, "model.block_size": 128},
    "w128-ctx256": {"model.n_embd": 128, "batch_size": 4, "model.block_size": 256},
}
LADDER_PRESET_ARMS = ["w64", "w128", "w256", "w128-tokens4x"]

E1_PRESETS: dict[str, Preset] = {
    "smoke": _e1("smoke", {}, [1, 2], [0]),
    "demo": _e1("small", DEMO_RUN, PAPER_DEPTHS, [0, 1]),
    "lab": _e1("small", LAB_RUN, PAPER_DEPTHS, [0, 1, 2]),
    "paper": _e1("paper", {}, PAPER_DEPTHS, [0, 1, 2, 3]),
    "ladder": Preset("small", LADDER_RUN, LADDER_SEEDS, arms=LADDER_PRESET_ARMS),
}


def ladder_arm(name: str) -> dict[str, Any]:
    """The ladder setting ``name`` (:data:`LADDER_ARMS`) as a grid arm."""
    if name not in LADDER_ARMS:
        raise QKGeomError(f"unknown E1 ladder setting {name!r}; choose one of "
                          f"{', '.join(LADDER_ARMS)}")
    return {"name": name, "set": dict(LADDER_ARMS[name])}


class E1(Experiment):
    name = "e1"
    presets = E1_PRESETS
    distinct_seeds = True
    arm = staticmethod(ladder_arm)
