"""One type for the paper's experiments: each owns its sizes (presets), its grid, how it
runs and how it is reported, so nothing re-decides them at a boundary.

``qkgeom reproduce NAME`` and the Python API both go through :func:`experiment`: ``grid``
builds the experiment's sweep once, ``run`` trains it (resumable), ``report`` writes the
report. The grid records the experiment's name (``sweep.json``), and the report reads it
back instead of guessing. Adding an experiment is one module with one :class:`Experiment`
subclass registered in :data:`EXPERIMENTS` (``qkgeom.experiments``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkgeom.config import deep_merge, nest_keys
from qkgeom.errors import QKGeomError
from qkgeom.experiments.grid import Grid
from qkgeom.experiments.runner import SweepSummary, available_cpus, on_this_machine, run_sweep


class Experiment:
    """An experiment of the paper. Subclasses set :attr:`name` and :attr:`presets` (each
    preset has ``train_preset`` and ``overrides``) and give the rest of their grid in
    :meth:`grid_dict`."""

    name: str = ""
    presets: dict[str, Any] = {}

    def preset(self, preset: str) -> Any:
        """The preset called ``preset``; a one-line error naming the others."""
        if preset not in self.presets:
            raise QKGeomError(f"unknown {self.name.upper()} preset {preset!r}; choose one of "
                              f"{', '.join(self.presets)}")
        return self.presets[preset]

    def grid_dict(self, spec: Any) -> dict[str, Any]:
        """The grid's axes and arms at the size ``spec`` (one of :attr:`presets`)."""
        raise NotImplementedError

    def grid(self, preset: str, data: str = "", overrides: dict[str, Any] | None = None) -> Grid:
        """The experiment's grid at size ``preset`` on the prepared corpus ``data`` (``""``:
        the embedded sample; the paper size needs a real corpus). ``overrides`` (nested or
        dotted keys, e.g. ``{"device": "cuda"}``) apply to every run; a key an arm sets is
        the arm's. The grid records them, so the sweep folder does too."""
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
        """Train ``grid`` into ``out_dir`` (resumable: :func:`run_sweep`; ``options`` are its
        keywords). ``workers=None`` picks the layout measured fastest (docs/speed.md): on a
        CPU one single-threaded run per core (small models do not scale across threads),
        except a ``paper``-preset grid, which gets every thread for one run; on CUDA the
        runner's ``runs_per_gpu``."""
        specs = grid.expand()
        on_cpu = not on_this_machine(specs[0]).config.device.startswith("cuda")
        if workers is None and grid.preset != "paper":
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
