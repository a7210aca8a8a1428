"""Sweep grids: a YAML file -> the cartesian product of runs, each with a stable id.

A grid names a base preset, overrides applied to every run (``base``) and ``axes``: config
fields (dotted, e.g. ``model.n_layer``) with the values to sweep. Runs are the cartesian
product of the axes in the order given (the last axis varies fastest)::

    name: e1-demo
    preset: demo
    base: {steps: 600}            # nested ({model: {n_head: 4}}) or dotted keys
    axes:
      model.n_layer: [4, 6, 8]
      model.qk_init: [normal, orthogonal, tied]
      seed: [0, 1, 2, 3]

``distinct_seeds: true`` gives every run its own seed: the ``seed`` axis then lists
replicates, and the r-th replicate of the i-th combination of the other axes (in product
order) trains with seed ``seeds[r] + i·len(seeds)`` (E1: depth × init cells that share a
seed would share their data order and every non-Q/K initial weight, so they would not be
independent units). Run ids show the seed each run trains with. Arms share their seed
(they are paired by it).

**Arms** (optional) are named sets of overrides crossed with the axes, for experiments
whose conditions are not one config field (E3: a mode, a scale rule and a dose)::

    arms:
      - {name: none, set: {key_control.mode: none, key_control.record: true}}
      - name: shrink-0.5-token-data
        set: {key_control.mode: shrink, key_control.dose: 0.5}
        reference: none

An arm with ``reference: <arm>`` depends on the run of that arm with the same axis values:
the expander sets its ``key_control.reference`` to that run's id (a sibling folder in the
sweep, resolved against the run folder's parent) and records the dependency
(:attr:`RunSpec.depends_on`); the sweep runner starts it only after that run is done.

**Run ids** are ``key=value`` pairs joined by commas, one per axis in axis order, e.g.
``n_layer=4,qk_init=normal,seed=0``. ``key`` is the last part of the dotted axis name (the
full dotted name when two axes share a last part); ``value`` is the value *after* config
validation (so ``4`` and ``4.0`` for an int field are the same run), printed as JSON scalars
print (``true``, ``0.001``, ``normal``), with every character outside ``[A-Za-z0-9._+-]``
replaced by ``_`` and values over 40 characters shortened to 32 plus a hash, then
``arm=<name>`` for a grid with arms (``seed=0,arm=shrink-0.5-token-data``; the last part varies
fastest). Ids depend only on the axes, arms and their values, never on the order of
expansion or the process, so a rerun finds its runs again. A grid without axes or arms is
one run, ``base``.

**Grid names** become the default sweep folder ``sweeps/<name>``: a name with a path
separator, a control character, or that is ``.``/``..`` is refused; the folder is named
after :attr:`Grid.folder_name`, the name with every character outside ``[A-Za-z0-9._+-]``
replaced by ``_`` (as in run ids), so no name reaches outside ``sweeps/``.

Everything is checked before any work: a file that is not a mapping, an unknown top-level
key, an unknown or invalid config value (through :func:`qkgeom.config.make_config`), an
empty axis, a repeated value, two runs with the same id, or an arm that is unnamed,
repeated, sets an axis, or references an unknown arm, itself, a cycle or an arm whose runs
do not record their key PR is a one-line :class:`~qkgeom.errors.QKGeomError`.

Limits, checked before anything is built: the file is read with the config's YAML limits
(no aliases, a node budget: :func:`qkgeom.config.load_yaml_file`), and a grid expands to
at most :data:`MAX_RUNS` runs (the product of the axis lengths and the arms, computed, not
enumerated). Every check is linear in the size of the grid.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkgeom.config import (
    PRESETS,
    TrainConfig,
    deep_merge,
    flatten,
    load_yaml_file,
    make_config,
    nest_keys,
)
from qkgeom.errors import QKGeomError
from qkgeom.runs.sweep import EXPERIMENT_NAMES

GRID_KEYS = ("name", "preset", "experiment", "base", "axes", "arms", "distinct_seeds")
ARM_KEYS = ("name", "set", "reference")
ARM_LABEL = "arm"  # the run-id label of the arm (and its key in RunSpec.axes)
# The sweep runner sets these per run (threads from --workers / --threads-per-run).
RUNNER_KEYS = ("threads",)
_SAFE = re.compile(r"[^A-Za-z0-9._+-]")
_UNSAFE_NAME = re.compile(r"[/\\\x00-\x1f\x7f]")
_MAX_VALUE_CHARS = 40
#: The most runs one grid may expand to (the paper's E1 grid has 36).
MAX_RUNS = 10_000


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its id, full validated config and the axis values that made it
    (with ``"arm"`` for a grid with arms); ``depends_on`` is the id of the run it must wait
    for (its arm's reference), or ""."""

    run_id: str
    config: TrainConfig
    axes: dict[str, Any] = field(default_factory=dict)
    depends_on: str = ""

    @property
    def config_hash(self) -> str:
        return self.config.config_hash()


@dataclass(frozen=True)
class Arm:
    """A named set of overrides (``set``, nested), crossed with the grid's axes; with
    ``reference`` the name of the arm whose run (same axis values) it depends on."""

    name: str
    set: dict[str, Any]
    reference: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "set": self.set}
        if self.reference:
            out["reference"] = self.reference
        return out


@dataclass(frozen=True)
class Grid:
    """A validated grid: ``base`` nested, ``axes`` flat (dotted key -> values, in order),
    ``arms`` in order (empty: a plain product of the axes)."""

    name: str
    preset: str
    base: dict[str, Any]
    axes: dict[str, list[Any]]
    arms: tuple[Arm, ...] = ()
    distinct_seeds: bool = False
    experiment: str = ""  # the paper's experiment it is (its report); "": the runs tell

    @classmethod
    def from_dict(cls, d: Any, *, default_name: str = "sweep") -> Grid:
        """Build and fully validate a grid (expands it once, so bad values fail here)."""
        if not isinstance(d, dict):
            raise QKGeomError("a grid must be a mapping with keys name, preset, base, axes, arms")
        unknown = [k for k in d if k not in GRID_KEYS]
        if unknown:
            raise QKGeomError(f"unknown grid key {unknown[0]!r}; a grid has {', '.join(GRID_KEYS)}")
        name = d.get("name", default_name)
        if not isinstance(name, str) or not name.strip():
            raise QKGeomError(f"grid name must be a non-empty string, got {name!r}")
        if _UNSAFE_NAME.search(name) or name.strip(".") == "":
            raise QKGeomError(f"grid name {name!r} is not a folder name (no path separators, "
                              "control characters, '.' or '..'): the sweep folder is "
                              "sweeps/<name>")
        preset = d.get("preset", "demo")
        if preset not in PRESETS:
            raise QKGeomError(f"grid {name!r}: unknown preset {preset!r}; "
                              f"choose one of {', '.join(PRESETS)}")
        base = d.get("base") or {}
        if not isinstance(base, dict):
            raise QKGeomError(f"grid {name!r}: base must be a mapping of config keys to values")
        axes_in = d.get("axes") or {}
        if not isinstance(axes_in, dict):
            raise QKGeomError(f"grid {name!r}: axes must be a mapping of config keys to lists")
        axes = _flat_axes(axes_in, name)
        distinct = d.get("distinct_seeds", False)
        if not isinstance(distinct, bool):
            raise QKGeomError(f"grid {name!r}: distinct_seeds must be true or false, got "
                              f"{distinct!r}")
        if distinct and "seed" not in axes:
            raise QKGeomError(f"grid {name!r}: distinct_seeds needs a seed axis (the "
                              "replicates of each combination of the other axes)")
        experiment = d.get("experiment", "")
        if experiment not in ("", *EXPERIMENT_NAMES):
            raise QKGeomError(f"grid {name!r}: experiment must be one of "
                              f"{', '.join(EXPERIMENT_NAMES)}, got {experiment!r}")
        grid = cls(name=name, preset=preset, base=nest_keys(base, f"grid {name!r}: base"),
                   axes=axes, arms=_arms(d.get("arms"), name, axes), distinct_seeds=distinct,
                   experiment=experiment)
        runs = grid.size
        if runs > MAX_RUNS:
            raise QKGeomError(f"grid {name!r} expands to {runs:,} runs; a sweep holds at most "
                              f"{MAX_RUNS:,}: split it into several grids")
        grid.expand()  # validates every run before anyone starts one
        return grid

    @property
    def size(self) -> int:
        """How many runs the grid expands to (axes × arms), without expanding it."""
        runs = max(len(self.arms), 1)
        for values in self.axes.values():
            runs *= len(values)
        return runs

    @property
    def folder_name(self) -> str:
        """The name as a safe folder name (``sweeps/<folder_name>``), like a run id's values."""
        return _SAFE.sub("_", self.name)

    def to_dict(self) -> dict[str, Any]:
        """The normalised grid (JSON-able); equal dicts mean the same sweep."""
        out = {"name": self.name, "preset": self.preset, "base": self.base,
               "axes": {k: list(v) for k, v in self.axes.items()}}
        if self.arms:  # absent for a grid without arms: its record stays as it was
            out["arms"] = [arm.to_dict() for arm in self.arms]
        if self.distinct_seeds:
            out["distinct_seeds"] = True
        if self.experiment:
            out["experiment"] = self.experiment
        return out

    def expand(self) -> list[RunSpec]:
        """Every run of the grid, in product order (axes, then arms), with validated configs,
        stable ids and each arm's dependency on its reference run."""
        where = f"grid {self.name!r}"
        try:
            make_config(self.preset, self.base)
        except QKGeomError as err:
            raise QKGeomError(f"{where}: base: {err}") from None
        for key, values in self.axes.items():
            try:
                make_config(self.preset, deep_merge(self.base,
                                                    nest_keys({key: values[0]}, where)))
            except QKGeomError as err:
                raise QKGeomError(f"{where}: axis {key!r}: {err}") from None
        labels = _labels(list(self.axes))
        specs: list[RunSpec] = []
        seen: dict[str, dict[str, Any]] = {}
        arms: tuple[Arm | None, ...] = self.arms or (None,)
        for combo in itertools.product(*self.axes.values()):
            axes = dict(zip(self.axes, combo, strict=True))
            if self.distinct_seeds:
                axes["seed"] = _cell_seed(self.axes, combo)
            over = deep_merge(self.base, nest_keys(axes, where))  # axes win over base
            try:
                flat = flatten(make_config(self.preset, over).to_dict())
                resolved = {k: flat[k] for k in axes}
            except QKGeomError as err:
                raise QKGeomError(f"{where}: run {axes}: {err}") from None
            stem = ",".join(f"{labels[k]}={_id_value(v)}" for k, v in resolved.items())
            for arm in arms:
                spec = self._spec(arm, over, stem, resolved, where)
                if spec.run_id in seen:
                    raise QKGeomError(f"{where}: runs {seen[spec.run_id]} and {spec.axes} get "
                                      f"the same run id {spec.run_id!r}; make the axis values "
                                      "distinct")
                seen[spec.run_id] = spec.axes
                specs.append(spec)
        _check_references(specs, where)
        return specs

    def _spec(self, arm: Arm | None, over: dict[str, Any], stem: str,
              resolved: dict[str, Any], where: str) -> RunSpec:
        """The run of ``arm`` (None: no arms) at the axis values ``resolved``."""
        if arm is None:
            try:
                cfg = make_config(self.preset, over)
            except QKGeomError as err:
                raise QKGeomError(f"{where}: run {resolved}: {err}") from None
            return RunSpec(run_id=stem or "base", config=cfg, axes=resolved)
        run_id = _arm_id(stem, arm.name)
        depends_on = _arm_id(stem, arm.reference) if arm.reference else ""
        over = deep_merge(over, arm.set)
        if depends_on:
            over = deep_merge(over, {"key_control": {"reference": depends_on}})
        try:
            cfg = make_config(self.preset, over)
        except QKGeomError as err:
            raise QKGeomError(f"{where}: arm {arm.name!r}, run {resolved}: {err}") from None
        return RunSpec(run_id=run_id, config=cfg, axes={**resolved, ARM_LABEL: arm.name},
                       depends_on=depends_on)


def load_grid(path: str | Path) -> Grid:
    """Read and validate a grid file (YAML or JSON); the name defaults to the file's stem."""
    path = Path(path)
    loaded = load_yaml_file(path, "grid file")
    if not isinstance(loaded, dict):
        raise QKGeomError(f"{path}: a grid file must be a mapping with keys "
                          f"{', '.join(GRID_KEYS)}")
    try:
        return Grid.from_dict(loaded, default_name=path.stem)
    except QKGeomError as err:
        raise QKGeomError(f"{path}: {err}") from None


# --- helpers -------------------------------------------------------------------------------


def _flat_axes(axes: dict[str, Any], name: str, prefix: str = "") -> dict[str, list[Any]]:
    """``{model: {n_layer: [..]}}`` or ``{model.n_layer: [..]}`` -> flat dotted keys."""
    out: dict[str, list[Any]] = {}
    for key, values in axes.items():
        if not isinstance(key, str) or not key:
            raise QKGeomError(f"grid {name!r}: axis names must be non-empty strings, got {key!r}")
        full = prefix + key
        if isinstance(values, dict):
            for k, v in _flat_axes(values, name, full + ".").items():
                if k in out:
                    raise QKGeomError(f"grid {name!r}: axis {k!r} is given twice")
                out[k] = v
            continue
        if full in out:
            raise QKGeomError(f"grid {name!r}: axis {full!r} is given twice")
        if full.split(".")[-1] in RUNNER_KEYS:
            raise QKGeomError(f"grid {name!r}: axis {full!r} is set by the sweep runner "
                              "(--workers / --threads-per-run), not by the grid")
        if not isinstance(values, list):
            raise QKGeomError(f"grid {name!r}: axis {full!r} must be a list of values, "
                              f"got {values!r}")
        if not values:
            raise QKGeomError(f"grid {name!r}: axis {full!r} is empty; give at least one value")
        for v in values:
            if isinstance(v, (dict, list)) or v is None:
                raise QKGeomError(f"grid {name!r}: axis {full!r} values must be scalars, "
                                  f"got {v!r}")
        seen: set[str] = set()
        for v in values:  # linear: a set, not a count per value
            key = json.dumps(v)
            if key in seen:
                raise QKGeomError(f"grid {name!r}: axis {full!r} lists {v!r} twice")
            seen.add(key)
        out[full] = list(values)
    return out


def _cell_seed(axes: dict[str, list[Any]], combo: tuple[Any, ...]) -> Any:
    """The seed of the run at ``combo`` under ``distinct_seeds``: its replicate's seed plus
    the number of replicates times the index of its combination of the other axes."""
    names = list(axes)
    seeds = axes["seed"]
    others = [(len(axes[k]), axes[k].index(v)) for k, v in zip(names, combo, strict=True)
              if k != "seed"]
    cell = 0
    for size, index in others:  # mixed-radix index, in axis order
        cell = cell * size + index
    value = combo[names.index("seed")]
    if not isinstance(value, int) or isinstance(value, bool):
        raise QKGeomError(f"distinct_seeds needs whole-number seeds, got {value!r}")
    return value + len(seeds) * cell


def _arm_id(stem: str, arm: str) -> str:
    return f"{stem},{ARM_LABEL}={arm}" if stem else f"{ARM_LABEL}={arm}"


def _arms(arms_in: Any, name: str, axes: dict[str, list[Any]]) -> tuple[Arm, ...]:
    """Validate the ``arms`` list: named, unique, safe names; ``set`` a mapping of config
    keys that no axis sweeps; ``reference`` another arm, no cycles."""
    where = f"grid {name!r}"
    if arms_in is None:
        return ()
    if not isinstance(arms_in, list) or not arms_in:
        raise QKGeomError(f"{where}: arms must be a non-empty list of {{name, set, reference}}")
    if ARM_LABEL in _labels(list(axes)).values():
        raise QKGeomError(f"{where}: an axis is labelled {ARM_LABEL!r}, which names the arms "
                          "in run ids")
    arms: list[Arm] = []
    names_seen: set[str] = set()
    for item in arms_in:
        if not isinstance(item, dict):
            raise QKGeomError(f"{where}: each arm must be a mapping with keys "
                              f"{', '.join(ARM_KEYS)}, got {item!r}")
        unknown = [k for k in item if k not in ARM_KEYS]
        if unknown:
            raise QKGeomError(f"{where}: unknown arm key {unknown[0]!r}; an arm has "
                              f"{', '.join(ARM_KEYS)}")
        arm_name = item.get("name")
        if not isinstance(arm_name, str) or not arm_name or _SAFE.search(arm_name):
            raise QKGeomError(f"{where}: arm names must be non-empty and use only letters, "
                              f"digits and . _ + -, got {arm_name!r}")
        if arm_name in names_seen:
            raise QKGeomError(f"{where}: arm {arm_name!r} is given twice")
        names_seen.add(arm_name)
        sets = item.get("set") or {}
        if not isinstance(sets, dict):
            raise QKGeomError(f"{where}: arm {arm_name!r}: set must be a mapping of config "
                              "keys to values")
        nested = nest_keys(sets, f"{where}: arm {arm_name!r}")
        clash = [k for k in axes if k in flatten(nested)]
        if clash:
            raise QKGeomError(f"{where}: arm {arm_name!r} sets {clash[0]!r}, which an axis "
                              "sweeps")
        ref = item.get("reference") or ""
        if not isinstance(ref, str):
            raise QKGeomError(f"{where}: arm {arm_name!r}: reference must be an arm name, "
                              f"got {ref!r}")
        if ref and "key_control.reference" in flatten(nested):
            raise QKGeomError(f"{where}: arm {arm_name!r} sets key_control.reference and "
                              "has a reference arm; give one of them")
        arms.append(Arm(name=arm_name, set=nested, reference=ref))
    names = {a.name: a for a in arms}
    for arm in arms:
        seen, ref = [arm.name], arm.reference
        while ref:
            if ref not in names:
                raise QKGeomError(f"{where}: arm {arm.name!r} references {ref!r}, which is not "
                                  f"an arm ({', '.join(names)})")
            if ref in seen:
                raise QKGeomError(f"{where}: arm references form a cycle "
                                  f"({' -> '.join([*seen, ref])})")
            seen.append(ref)
            ref = names[ref].reference
    return tuple(arms)


def _check_references(specs: list[RunSpec], where: str) -> None:
    """A reference run must record its key PR and train at least as many steps."""
    by_id = {s.run_id: s for s in specs}
    for spec in specs:
        if not spec.depends_on:
            continue
        ref = by_id[spec.depends_on].config
        if not ref.key_control.record:
            raise QKGeomError(f"{where}: run {spec.run_id!r} references {spec.depends_on!r}, "
                              "which does not record its key PR (set key_control.record: "
                              "true in that arm)")
        if ref.steps < spec.config.steps:
            raise QKGeomError(f"{where}: run {spec.run_id!r} trains {spec.config.steps} steps "
                              f"but its reference {spec.depends_on!r} only {ref.steps}")


def _labels(keys: list[str]) -> dict[str, str]:
    """Short id labels: the last dotted part, or the whole key where that part repeats."""
    last = [k.split(".")[-1] for k in keys]
    counts = Counter(last)  # linear in the number of axes
    return {k: (s if counts[s] == 1 else k) for k, s in zip(keys, last, strict=True)}


def _id_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    safe = _SAFE.sub("_", text) or "_"
    if len(safe) > _MAX_VALUE_CHARS:
        digest = hashlib.sha256(text.encode()).hexdigest()[:7]
        safe = f"{safe[:32]}-{digest}"
    return safe


__all__ = ["Arm", "Grid", "RunSpec", "load_grid"]
