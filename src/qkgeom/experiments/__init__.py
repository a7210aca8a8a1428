"""Experiments: sweep grids, the sweep runner (local processes or Ray), the paper's
experiments.

``load_grid`` / ``Grid.from_dict`` read a grid, ``Grid.expand`` gives its runs,
``run_sweep`` trains them into a resumable sweep folder (each through ``run_one``) and
``sweep_status`` tabulates it. Each experiment (``e1``: E1 and E2, ``e3``, ``e4``,
``stability``) is one :class:`Experiment`, found by :func:`experiment`; :func:`reproduce`
runs one end to end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkgeom.errors import QKGeomError
from qkgeom.experiments.e1 import E1, E1_PRESETS
from qkgeom.experiments.e3 import E3, E3_PRESETS, e3_arm
from qkgeom.experiments.e4 import E4, E4_PRESETS
from qkgeom.experiments.experiment import Experiment
from qkgeom.experiments.grid import Arm, Grid, RunSpec, load_grid
from qkgeom.experiments.runner import SweepSummary, run_sweep, sweep_status
from qkgeom.experiments.stability import STABILITY_PRESETS, Stability
from qkgeom.experiments.worker import run_one

#: Every experiment ``qkgeom reproduce`` runs, by name.
EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (E1(), E3(), E4(), Stability())}


def experiment(name: str) -> Experiment:
    """The experiment called ``name``; a one-line error otherwise (``e2`` points at ``e1``,
    whose runs E2's claims are measured on)."""
    if name in EXPERIMENTS:
        return EXPERIMENTS[name]
    hint = ("E2 is part of e1 (`qkgeom reproduce e1` runs E1 and E2 on one grid); "
            if name.lower() == "e2" else "")
    raise QKGeomError(f"unknown experiment {name!r}; {hint}choose one of "
                      f"{', '.join(EXPERIMENTS)}")


def reproduce(name: str, preset: str, out_dir: str | Path | None = None, data: str = "",
              *, overrides: dict[str, Any] | None = None, **options: Any) -> Any:
    """Run the experiment ``name`` at size ``preset`` into ``out_dir`` (default
    ``sweeps/<name>-<preset>``), resumable. E4: ``options`` are :meth:`E4.run`'s, returns
    the folder it reported; the others: :func:`run_sweep`'s, returns the SweepSummary."""
    exp = experiment(name)
    if isinstance(exp, E4):
        return exp.run(preset, out_dir, data=data, overrides=overrides, **options)
    grid = exp.grid(preset, data, overrides)
    return exp.run(grid, out_dir or exp.default_out(preset), **options)


def summary(exp: Experiment) -> str:
    """What ``exp`` is, in one line: the first paragraph of its module's docstring (the one
    description an experiment has), its lines joined."""
    import sys

    doc = (sys.modules[type(exp).__module__].__doc__ or "").strip()
    return " ".join(doc.split("\n\n")[0].split()).rstrip(".") if doc else exp.name


def reproduce_help() -> dict[str, str]:
    """The help of ``qkgeom reproduce``'s ``experiment`` argument and ``--preset`` option,
    generated from :data:`EXPERIMENTS` and each one's presets, so a new experiment or
    preset is listed without anyone restating it."""
    experiments = " | ".join(f"{name} ({summary(exp)}; presets: {', '.join(exp.presets)})"
                             for name, exp in EXPERIMENTS.items())
    names = list(dict.fromkeys(p for exp in EXPERIMENTS.values() for p in exp.presets))
    return {"experiment": experiments,
            "preset": f"The experiment's size, one of its presets ({' | '.join(names)}; each "
                      "experiment's are listed above): smoke takes seconds, demo minutes on "
                      "a CPU, lab about an hour a run on 2 CPU cores, paper GPU-hours (pass "
                      "--data); docs/sweeps.md."}


#: E4 end to end (:meth:`E4.run`): returns the folder whose report was written.
reproduce_e4 = EXPERIMENTS["e4"].run


__all__ = ["Arm", "Grid", "RunSpec", "load_grid", "run_sweep", "run_one", "sweep_status",
           "SweepSummary", "Experiment", "EXPERIMENTS", "experiment", "reproduce",
           "reproduce_help", "summary",
           "reproduce_e4", "E1_PRESETS", "E3_PRESETS", "E4_PRESETS", "STABILITY_PRESETS",
           "e3_arm"]
