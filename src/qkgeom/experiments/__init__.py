"""Experiments: sweep grids, the sweep runner (local processes or Ray), the paper's grids.

``load_grid`` / ``Grid.from_dict`` read a grid; ``Grid.expand`` gives its runs with stable
ids; ``run_sweep`` trains them into a resumable sweep folder (every run through
``run_one``, in persistent local worker processes or Ray tasks, packed ``runs_per_gpu`` to a
GPU on CUDA grids); ``sweep_status`` tabulates a sweep folder; ``e1_grid`` /
``reproduce_e1`` are experiment E1 of the paper and ``e3_grid`` / ``reproduce_e3`` experiment
E3, whose conditions are named arms (``e3_arm``) crossed with the seeds
(docs/definitions.md).
"""

from qkgeom.experiments.grid import Arm, Grid, RunSpec, load_grid
from qkgeom.experiments.presets import (
    E1_PRESETS,
    E3_PRESETS,
    GRIDS,
    e1_grid,
    e3_arm,
    e3_grid,
    reproduce,
    reproduce_e1,
    reproduce_e3,
    reproduce_e4,
)
from qkgeom.experiments.runner import SweepSummary, run_sweep, sweep_status
from qkgeom.experiments.worker import run_one

__all__ = ["Arm", "Grid", "RunSpec", "load_grid", "run_sweep", "run_one", "sweep_status",
           "SweepSummary", "e1_grid", "reproduce_e1", "E1_PRESETS", "e3_grid", "reproduce_e3",
           "E3_PRESETS", "GRIDS", "e3_arm", "reproduce", "reproduce_e4"]
