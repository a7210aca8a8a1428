"""E1 and E2: depths x Q/K inits x replicates, every run with its own seed.

``distinct_seeds``: runs sharing a seed would share their data order and, within a depth,
every initial weight but W_Q/W_K, so they would not be independent units. E2's claims are
measured on the same runs. Sizes: docs/definitions.md#e1-and-e2.
"""

from __future__ import annotations

from typing import Any

from qkgeom.config import QK_INITS
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

E1_PRESETS: dict[str, Preset] = {
    "smoke": _e1("smoke", {}, [1, 2], [0]),
    "demo": _e1("small", DEMO_RUN, PAPER_DEPTHS, [0, 1]),
    "lab": _e1("small", LAB_RUN, PAPER_DEPTHS, [0, 1, 2]),
    "paper": _e1("paper", {}, PAPER_DEPTHS, [0, 1, 2, 3]),
}


class E1(Experiment):
    name = "e1"
    presets = E1_PRESETS
    distinct_seeds = True
