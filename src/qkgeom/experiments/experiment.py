"""One type for the paper's experiments: each owns its presets, its grid, how it runs and
how it is reported, so nothing re-decides them at a boundary.

``qkgeom reproduce NAME`` and the Python API both go through :func:`experiment`. The grid
records the experiment's name in ``sweep.json`` and the report reads it back. Adding an
experiment: one module with one subclass in :data:`EXPERIMENTS` (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkgeom.config import deep_merge, nest_keys
from qkgeom.errors import QKGeomError
from qkgeom.experiments.grid import Grid
from qkgeom.experiments.runner import SweepSummary, available_cpus, on_this_machine, run_sweep


@dataclass(frozen=True)
class Preset:
    """One size of an experiment: the training preset (None: it trains nothing), the
    overrides every run gets, the seeds (the grid's last axis), the axes before them, the
    arms by name (:meth:`Experiment.arm`) and the model sizes (name -> overrides: several
    models in one sweep, crossed outermost, paired within a size)."""

    train_preset: str | None
    overrides: dict[str, Any]
    seeds: Sequence[int] = ()
    axes: dict[str, list[Any]] = field(default_factory=dict)
    arms: list[str] = field(default_factory=list)
    sizes: dict[str, dict[str, Any]] = field(default_factory=dict)


class Experiment:
    """An experiment of the paper: :attr:`name`, :attr:`presets` and, with arms, :meth:`arm`;
    ``distinct_seeds``: every run gets its own seed (:class:`~qkgeom.experiments.grid.Grid`)."""

    name: str = ""
    presets: dict[str, Preset] = {}
    distinct_seeds: bool = False

    def preset(self, preset: str) -> Preset:
        """The preset called ``preset``; a one-line error naming the others."""
        if preset not in self.presets:
            raise QKGeomError(f"unknown {self.name.upper()} preset {preset!r}; choose one of "
                              f"{', '.join(self.presets)}")
        return self.presets[preset]

    def arm(self, name: str) -> dict[str, Any]:
        """The grid arm called ``name``, for the experiments that have arms."""
        raise NotImplementedError

    def grid_dict(self, spec: Preset) -> dict[str, Any]:
        """The grid's axes and arms at the size ``spec`` (one of :attr:`presets`)."""
        grid: dict[str, Any] = {"axes": {**spec.axes, "seed": list(spec.seeds)}}
        if spec.arms:
            grid["arms"] = [self.arm(a) for a in spec.arms]
        if spec.sizes:
            grid["sizes"] = [{"name": k, "set": v} for k, v in spec.sizes.items()]
        if self.distinct_seeds:
            grid["distinct_seeds"] = True
        return grid

    def grid(self, preset: str, data: str = "", overrides: dict[str, Any] | None = None) -> Grid:
        """The grid at size ``preset`` on the prepared corpus ``data`` (``""``: the embedded
        sample; the paper size needs a real corpus). ``overrides`` (nested or dotted keys)
        apply to every run unless an arm sets the key; the grid records them."""
        spec = self.preset(preset)
        if preset == "paper" and not data:
            raise QKGeomError(f"the paper {self.name.upper()} grid trains on WikiText-103: pass "
                              "data=<folder prepared with `qkgeom data prepare --source "
                              "wikitext-103`>")
        base = deep_merge(nest_keys(spec.overrides, f"{self.name} base"),
                          nest_keys(overrides or {}, f"{self.name} overrides"))
        if data:
            base["data"] = str(data)
        return Grid.from_dict({"name": f"{self.name}-{preset}", "preset": spec.train_preset,
                               "experiment": self.name, "base": base,
                               **self.grid_dict(spec)})

    def default_out(self, preset: str) -> Path:
        return Path("sweeps") / f"{self.name}-{preset}"

    def run(self, grid: Grid, out_dir: str | Path, *, workers: int | None = None,
            threads_per_run: int | None = None, **options: Any) -> SweepSummary:
        """Train ``grid`` into ``out_dir``, resumable (``options``: :func:`run_sweep`'s).
        ``workers=None`` picks the layout measured fastest (docs/speed.md): on a CPU one
        single-threaded run per core, except a ``paper`` grid (every thread for one run); on
        CUDA the runner's ``runs_per_gpu``."""
        specs = grid.expand()
        on_cpu = not on_this_machine(specs[0]).config.device.startswith("cuda")
        if workers is None and on_cpu and grid.preset != "paper":
            workers = max(1, min(available_cpus(), len(specs)))
            threads_per_run = 1 if threads_per_run is None else threads_per_run
        elif workers is None and on_cpu:
            workers = 1
        return run_sweep(grid, out_dir, workers=workers, threads_per_run=threads_per_run,
                         **options)

    def report(self, folder: str | Path) -> Path:
        """Write the report of a folder this experiment ran; returns ``report.md``."""
        from qkgeom.analysis import write_report

        return write_report(folder)
