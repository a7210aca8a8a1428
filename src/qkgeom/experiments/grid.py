"""Sweep grids: a YAML file -> the cartesian product of runs, each with a stable id.

A grid names a base preset, overrides for every run (``base``), ``axes`` (dotted config
fields and the values to sweep; the last axis varies fastest) and optionally ``arms``
(named sets of overrides crossed with the axes, an arm's run depending on its
``reference`` arm's) and ``sizes`` (named model sizes, each a set of overrides, crossed
outermost: several models in one sweep, paired within a size). Run ids depend only on the axis values (after config validation) and
the arm, so a rerun finds its runs again. Everything is checked before any run starts, in
one line per error; the format, ids and limits are in docs/sweeps.md#grid-files.
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

GRID_KEYS = ("name", "preset", "experiment", "base", "axes", "arms", "sizes",
             "distinct_seeds")
ARM_KEYS = ("name", "set", "reference")
ARM_LABEL = "arm"  # the run-id label of the arm (and its key in RunSpec.axes)
SIZE_LABEL = "size"  # the run-id label of the size (and its key in RunSpec.axes)
SIZE_KEYS = ("name", "set")
RUNNER_KEYS = ("threads",)  # set per run by the sweep runner (--workers / --threads)
_SAFE = re.compile(r"[^A-Za-z0-9._+-]")
_UNSAFE_NAME = re.compile(r"[/\\\x00-\x1f\x7f]")
_MAX_VALUE_CHARS = 40
#: The most runs one grid may expand to (counted, not enumerated).
MAX_RUNS = 10_000


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its id, validated config and the axis values that made it
    (with ``"arm"`` for a grid with arms); ``depends_on``: the run it waits for, or ""."""

    run_id: str
    config: TrainConfig
    axes: dict[str, Any] = field(default_factory=dict)
    depends_on: str = ""

    @property
    def config_hash(self) -> str:
        return self.config.config_hash()


@dataclass(frozen=True)
class Arm:
    """Overrides (``set``, nested) crossed with the axes; ``reference``: the arm whose run
    at the same axis values this one depends on."""

    name: str
    set: dict[str, Any]
    reference: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "set": self.set,
                **({"reference": self.reference} if self.reference else {})}


@dataclass(frozen=True)
class Size:
    """A named model size: overrides (``set``, nested) applied under the axes and arms."""

    name: str
    set: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "set": self.set}


@dataclass(frozen=True)
class Grid:
    """A validated grid: ``base`` nested, ``axes`` flat (dotted key -> values, in order),
    ``arms`` in order (empty: a plain product of the axes), ``sizes`` in order (empty: the
    base's one model)."""

    name: str
    preset: str
    base: dict[str, Any]
    axes: dict[str, list[Any]]
    arms: tuple[Arm, ...] = ()
    distinct_seeds: bool = False
    experiment: str = ""  # the experiment it is (its report); "": the runs tell
    sizes: tuple[Size, ...] = ()

    @classmethod
    def from_dict(cls, d: Any, *, default_name: str = "sweep") -> Grid:
        """Build and fully validate a grid (expands it once, so bad values fail here)."""
        if not isinstance(d, dict):
            raise QKGeomError("a grid must be a mapping with keys name, preset, base, axes, arms")
        unknown = [k for k in d if k not in GRID_KEYS]
        if unknown:
            raise QKGeomError(f"unknown grid key {unknown[0]!r}; a grid has {', '.join(GRID_KEYS)}")
        name = _grid_name(d.get("name", default_name))
        where = f"grid {name!r}"
        preset, base, axes_in = d.get("preset", "small"), d.get("base") or {}, d.get("axes") or {}
        distinct, experiment = d.get("distinct_seeds", False), d.get("experiment", "")
        if preset not in PRESETS:
            raise QKGeomError(f"{where}: unknown preset {preset!r}; "
                              f"choose one of {', '.join(PRESETS)}")
        if not isinstance(base, dict):
            raise QKGeomError(f"{where}: base must be a mapping of config keys to values")
        if not isinstance(axes_in, dict):
            raise QKGeomError(f"{where}: axes must be a mapping of config keys to lists")
        axes = _flat_axes(axes_in, where)
        if not isinstance(distinct, bool):
            raise QKGeomError(f"{where}: distinct_seeds must be true or false, got {distinct!r}")
        if distinct and "seed" not in axes:
            raise QKGeomError(f"{where}: distinct_seeds needs a seed axis (the replicates of "
                              "each combination of the other axes)")
        from qkgeom.experiments import EXPERIMENTS

        if experiment not in ("", *EXPERIMENTS):
            raise QKGeomError(f"{where}: experiment must be one of {', '.join(EXPERIMENTS)}, "
                              f"got {experiment!r}")
        arms = _arms(d.get("arms"), where, axes)
        grid = cls(name=name, preset=preset, base=nest_keys(base, f"{where}: base"), axes=axes,
                   arms=arms, distinct_seeds=distinct, experiment=experiment,
                   sizes=_sizes(d.get("sizes"), where, axes, arms))
        if grid.size > MAX_RUNS:
            raise QKGeomError(f"{where} expands to {grid.size:,} runs; a sweep holds at most "
                              f"{MAX_RUNS:,}: split it into several grids")
        grid.expand()  # validates every run before anyone starts one
        return grid

    @property
    def size(self) -> int:
        """How many runs the grid expands to (sizes × axes × arms), without expanding it."""
        runs = max(len(self.arms), 1) * max(len(self.sizes), 1)
        for values in self.axes.values():
            runs *= len(values)
        return runs

    @property
    def folder_name(self) -> str:
        """The name as a safe folder name (``sweeps/<folder_name>``), like a run id's values."""
        return _SAFE.sub("_", self.name)

    def to_dict(self) -> dict[str, Any]:
        """The normalised grid (JSON-able); equal dicts mean the same sweep."""
        return {"name": self.name, "preset": self.preset, "base": self.base,
                "axes": {k: list(v) for k, v in self.axes.items()},
                **({"arms": [arm.to_dict() for arm in self.arms]} if self.arms else {}),
                **({"sizes": [s.to_dict() for s in self.sizes]} if self.sizes else {}),
                **({"distinct_seeds": True} if self.distinct_seeds else {}),
                **({"experiment": self.experiment} if self.experiment else {})}

    def expand(self) -> list[RunSpec]:
        """Every run of the grid, in product order (sizes, axes, then arms), with validated
        configs, stable ids and each arm's dependency on its reference run."""
        where = f"grid {self.name!r}"
        self._check_each_setting(where)
        labels = _labels(list(self.axes))
        specs: list[RunSpec] = []
        seen: dict[str, dict[str, Any]] = {}
        sizes: tuple[Size | None, ...] = self.sizes or (None,)
        for (i, size), combo in itertools.product(enumerate(sizes),
                                                  itertools.product(*self.axes.values())):
            axes = dict(zip(self.axes, combo, strict=True))
            if self.distinct_seeds:
                axes["seed"] = _cell_seed(self.axes, combo, i)
            base = deep_merge(self.base, size.set) if size else self.base
            over = deep_merge(base, nest_keys(axes, where))  # axes win over base
            try:
                cfg = make_config(self.preset, over)
            except QKGeomError as err:
                at = {SIZE_LABEL: size.name, **axes} if size else axes
                raise QKGeomError(f"{where}: run {at}: {err}") from None
            flat = flatten(cfg.to_dict())
            resolved = {k: flat[k] for k in axes}
            stem = ",".join([*([f"{SIZE_LABEL}={size.name}"] if size else []),
                             *(f"{labels[k]}={_id_value(v)}" for k, v in resolved.items())])
            if size:
                resolved = {SIZE_LABEL: size.name, **resolved}
            runs = (self._arm_spec(a, over, stem, resolved, where) for a in self.arms) \
                if self.arms else [RunSpec(run_id=stem or "base", config=cfg, axes=resolved)]
            for spec in runs:
                if spec.run_id in seen:
                    raise QKGeomError(f"{where}: runs {seen[spec.run_id]} and {spec.axes} get "
                                      f"the same run id {spec.run_id!r}; make the axis values "
                                      "distinct")
                seen[spec.run_id] = spec.axes
                specs.append(spec)
        _check_references(specs, where)
        return specs

    def _check_each_setting(self, where: str) -> None:
        """The base, each size and each axis on its own: an error names the setting that
        causes it."""
        try:
            make_config(self.preset, self.base)
        except QKGeomError as err:
            raise QKGeomError(f"{where}: base: {err}") from None
        for size in self.sizes:
            try:
                make_config(self.preset, deep_merge(self.base, size.set))
            except QKGeomError as err:
                raise QKGeomError(f"{where}: size {size.name!r}: {err}") from None
        for key, values in self.axes.items():
            try:
                make_config(self.preset, deep_merge(self.base, nest_keys({key: values[0]}, where)))
            except QKGeomError as err:
                raise QKGeomError(f"{where}: axis {key!r}: {err}") from None

    def _arm_spec(self, arm: Arm, over: dict[str, Any], stem: str, resolved: dict[str, Any],
                  where: str) -> RunSpec:
        """The run of ``arm`` at the axis values ``resolved``."""
        depends_on = _arm_id(stem, arm.reference) if arm.reference else ""
        over = deep_merge(over, arm.set)
        if depends_on:
            over = deep_merge(over, {"key_control": {"reference": depends_on}})
        try:
            cfg = make_config(self.preset, over)
        except QKGeomError as err:
            raise QKGeomError(f"{where}: arm {arm.name!r}, run {resolved}: {err}") from None
        return RunSpec(run_id=_arm_id(stem, arm.name), config=cfg,
                       axes={**resolved, ARM_LABEL: arm.name}, depends_on=depends_on)


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


def _grid_name(name: Any) -> str:
    """The grid's name, which names its default folder ``sweeps/<name>``."""
    if not isinstance(name, str) or not name.strip():
        raise QKGeomError(f"grid name must be a non-empty string, got {name!r}")
    if _UNSAFE_NAME.search(name) or name.strip(".") == "":
        raise QKGeomError(f"grid name {name!r} is not a folder name (no path separators, "
                          "control characters, '.' or '..'): the sweep folder is sweeps/<name>")
    return name


def _flat_axes(axes: dict[str, Any], where: str, prefix: str = "") -> dict[str, list[Any]]:
    """``{model: {n_layer: [..]}}`` or ``{model.n_layer: [..]}`` -> flat dotted keys."""
    out: dict[str, list[Any]] = {}
    for key, values in axes.items():
        if not isinstance(key, str) or not key:
            raise QKGeomError(f"{where}: axis names must be non-empty strings, got {key!r}")
        full = prefix + key
        inner = _flat_axes(values, where, full + ".") if isinstance(values, dict) \
            else {full: values}
        for k, v in inner.items():
            if k in out:
                raise QKGeomError(f"{where}: axis {k!r} is given twice")
            out[k] = v if isinstance(values, dict) else _axis_values(k, v, where)
    return out


def _axis_values(key: str, values: Any, where: str) -> list[Any]:
    if key.split(".")[-1] in RUNNER_KEYS:
        raise QKGeomError(f"{where}: axis {key!r} is set by the sweep runner "
                          "(--workers / --threads-per-run), not by the grid")
    if not isinstance(values, list):
        raise QKGeomError(f"{where}: axis {key!r} must be a list of values, got {values!r}")
    if not values:
        raise QKGeomError(f"{where}: axis {key!r} is empty; give at least one value")
    for v in values:
        if isinstance(v, (dict, list)) or v is None:
            raise QKGeomError(f"{where}: axis {key!r} values must be scalars, got {v!r}")
    seen: set[str] = set()
    for v in values:  # linear: a set, not a count per value
        if json.dumps(v) in seen:
            raise QKGeomError(f"{where}: axis {key!r} lists {v!r} twice")
        seen.add(json.dumps(v))
    return list(values)


def _cell_seed(axes: dict[str, list[Any]], combo: tuple[Any, ...], size: int = 0) -> Any:
    """The seed under ``distinct_seeds``: the replicate's seed plus the number of
    replicates times the (mixed-radix) index of the run's combination of the size (index
    ``size``) and the other axes."""
    names = list(axes)
    cell = size
    for k, v in zip(names, combo, strict=True):
        if k != "seed":
            cell = cell * len(axes[k]) + axes[k].index(v)
    value = combo[names.index("seed")]
    if not isinstance(value, int) or isinstance(value, bool):
        raise QKGeomError(f"distinct_seeds needs whole-number seeds, got {value!r}")
    return value + len(axes["seed"]) * cell


def _arm_id(stem: str, arm: str) -> str:
    return f"{stem},{ARM_LABEL}={arm}" if stem else f"{ARM_LABEL}={arm}"


def _arms(arms_in: Any, where: str, axes: dict[str, list[Any]]) -> tuple[Arm, ...]:
    """The ``arms`` list, validated; ``reference`` another arm, no cycles."""
    if arms_in is None:
        return ()
    if not isinstance(arms_in, list) or not arms_in:
        raise QKGeomError(f"{where}: arms must be a non-empty list of {{name, set, reference}}")
    if ARM_LABEL in _labels(list(axes)).values():
        raise QKGeomError(f"{where}: an axis is labelled {ARM_LABEL!r}, which names the arms "
                          "in run ids")
    arms: dict[str, Arm] = {}
    for item in arms_in:
        arm = _arm(item, where, axes)
        if arm.name in arms:
            raise QKGeomError(f"{where}: arm {arm.name!r} is given twice")
        arms[arm.name] = arm
    for arm in arms.values():
        seen, ref = [arm.name], arm.reference
        while ref:
            if ref not in arms:
                raise QKGeomError(f"{where}: arm {arm.name!r} references {ref!r}, which is not "
                                  f"an arm ({', '.join(arms)})")
            if ref in seen:
                raise QKGeomError(f"{where}: arm references form a cycle "
                                  f"({' -> '.join([*seen, ref])})")
            seen.append(ref)
            ref = arms[ref].reference
    return tuple(arms.values())


def _sizes(sizes_in: Any, where: str, axes: dict[str, list[Any]],
           arms: tuple[Arm, ...]) -> tuple[Size, ...]:
    """The ``sizes`` list, validated: each a safe unique name and a mapping of config keys
    that no axis sweeps and no arm sets."""
    if sizes_in is None:
        return ()
    if not isinstance(sizes_in, list) or not sizes_in:
        raise QKGeomError(f"{where}: sizes must be a non-empty list of {{name, set}}")
    if SIZE_LABEL in _labels(list(axes)).values():
        raise QKGeomError(f"{where}: an axis is labelled {SIZE_LABEL!r}, which names the "
                          "sizes in run ids")
    armed = {k for arm in arms for k in flatten(arm.set)}
    out: dict[str, Size] = {}
    for item in sizes_in:
        if not isinstance(item, dict) or [k for k in item if k not in SIZE_KEYS]:
            raise QKGeomError(f"{where}: each size must be a mapping with keys "
                              f"{', '.join(SIZE_KEYS)}, got {item!r}")
        name, sets = item.get("name"), item.get("set") or {}
        if not isinstance(name, str) or not name or _SAFE.search(name):
            raise QKGeomError(f"{where}: size names must be non-empty and use only letters, "
                              f"digits and . _ + -, got {name!r}")
        if name in out:
            raise QKGeomError(f"{where}: size {name!r} is given twice")
        if not isinstance(sets, dict):
            raise QKGeomError(f"{where}: size {name!r}: set must be a mapping of config keys "
                              "to values")
        nested = nest_keys(sets, f"{where}: size {name!r}")
        flat = flatten(nested)
        clash = [k for k in flat if k in axes or k in armed]
        if clash:
            raise QKGeomError(f"{where}: size {name!r} sets {clash[0]!r}, which "
                              f"{'an axis sweeps' if clash[0] in axes else 'an arm sets'}")
        out[name] = Size(name=name, set=nested)
    return tuple(out.values())


def _arm(item: Any, where: str, axes: dict[str, list[Any]]) -> Arm:
    """One arm: a safe name, ``set`` a mapping of config keys no axis sweeps, ``reference``
    an arm name."""
    if not isinstance(item, dict):
        raise QKGeomError(f"{where}: each arm must be a mapping with keys "
                          f"{', '.join(ARM_KEYS)}, got {item!r}")
    unknown = [k for k in item if k not in ARM_KEYS]
    if unknown:
        raise QKGeomError(f"{where}: unknown arm key {unknown[0]!r}; an arm has "
                          f"{', '.join(ARM_KEYS)}")
    name, sets, ref = item.get("name"), item.get("set") or {}, item.get("reference") or ""
    if not isinstance(name, str) or not name or _SAFE.search(name):
        raise QKGeomError(f"{where}: arm names must be non-empty and use only letters, "
                          f"digits and . _ + -, got {name!r}")
    if not isinstance(sets, dict):
        raise QKGeomError(f"{where}: arm {name!r}: set must be a mapping of config keys to "
                          "values")
    nested = nest_keys(sets, f"{where}: arm {name!r}")
    flat = flatten(nested)
    clash = [k for k in axes if k in flat]
    if clash:
        raise QKGeomError(f"{where}: arm {name!r} sets {clash[0]!r}, which an axis sweeps")
    if not isinstance(ref, str):
        raise QKGeomError(f"{where}: arm {name!r}: reference must be an arm name, got {ref!r}")
    if ref and "key_control.reference" in flat:
        raise QKGeomError(f"{where}: arm {name!r} sets key_control.reference and has a "
                          "reference arm; give one of them")
    return Arm(name=name, set=nested, reference=ref)


def _check_references(specs: list[RunSpec], where: str) -> None:
    """A reference run must record its key PR and train at least as many steps."""
    by_id = {s.run_id: s for s in specs}
    for spec in (s for s in specs if s.depends_on):
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
    counts = Counter(last)
    return {k: (s if counts[s] == 1 else k) for k, s in zip(keys, last, strict=True)}


def _id_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    safe = _SAFE.sub("_", text) or "_"
    if len(safe) > _MAX_VALUE_CHARS:
        safe = f"{safe[:32]}-{hashlib.sha256(text.encode()).hexdigest()[:7]}"
    return safe


__all__ = ["Arm", "Grid", "RunSpec", "Size", "load_grid"]
