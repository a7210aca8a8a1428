"""One schema per file of a run or sweep folder, checked when the file is read.

Why: a result folder may come from someone else or be edited by hand, and valid JSON or
Parquet can still hold the wrong types (``"step": "five"``). A bad file is then one line
naming it, never a ``TypeError`` deep in a table. Extra keys and columns are allowed (a
newer qkgeom may add some): only what the readers use is checked.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QKGeomError

if TYPE_CHECKING:
    import pandas as pd

#: Run-folder tables: column -> kind (int: an integer dtype, so a NaN is refused; float;
#: str), and which columns must be there.
TABLES: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "metrics.parquet": ({"step": "int", "layer": "int", "head": "int", "metric": "str",
                         "value": "float", "run_id": "str"},
                        ("step", "layer", "head", "metric", "value")),
    "train_log.parquet": ({"step": "int", "loss": "float", "val_loss": "float", "lr": "float",
                           "tokens_per_s": "float"}, ("step",)),
    "key_pr.parquet": ({"step": "int", "unit": "str", "pr": "float", "pr_token": "float",
                        "spread": "float"}, ("step", "unit", "pr")),
}
#: The table a part file (``metrics.parts/p…-L0.parquet``) belongs to.
PARTS = {"metrics.parts": "metrics.parquet", "train_log.parts": "train_log.parquet"}

_INT, _NUM, _TEXT, _NONE = (int,), (int, float), (str,), (type(None),)
#: status.json: key -> (allowed types, required).
STATUS_KEYS: dict[str, tuple[tuple[type, ...], bool]] = {
    "state": (_TEXT, True), "step": (_INT, True), "steps": (_INT, False),
    "started": (_NUM, False), "updated": (_NUM, False), "wall_s": (_NUM, False),
    "threads": (_INT, False), "diverged_step": (_INT, False),
    "error": (_TEXT + _NONE, False), "message": (_TEXT + _NONE, False),
    "checkpoint": (_INT + _NONE, False), "signal": (_TEXT, False),
}
#: One entry of sweep.json's ``runs``.
SWEEP_RUN_KEYS: dict[str, tuple[tuple[type, ...], bool]] = {
    "run_id": (_TEXT, True), "axes": ((dict,), False), "config_hash": (_TEXT, False),
    "steps": (_INT, False), "depends_on": (_TEXT, False),
}
_KIND_WORDS = {"int": "whole numbers", "float": "numbers", "str": "text"}
_TYPE_WORDS = {int: "a whole number", float: "a number", str: "text", dict: "a mapping",
               type(None): "null"}


def _kind_ok(series: pd.Series, kind: str) -> bool:
    from pandas.api import types

    if types.is_bool_dtype(series.dtype):
        return False
    if kind == "int":
        return types.is_integer_dtype(series.dtype)
    if kind == "float":
        return types.is_float_dtype(series.dtype) or types.is_integer_dtype(series.dtype)
    return (types.is_string_dtype(series.dtype) or types.is_object_dtype(series.dtype)) \
        and bool(series.map(lambda v: isinstance(v, str)).all())


def check_table(frame: pd.DataFrame, path: Path, columns: tuple[str, ...] = ()) -> None:
    """QKGeomError naming ``path`` unless ``frame`` has ``columns`` and the required ones of
    its table's schema (a base file or one of its parts), and every schema column it has is
    of the schema's kind."""
    table = path.name if path.name in TABLES else PARTS.get(path.parent.name)
    kinds, required = TABLES[table] if table else ({}, ())
    missing = [c for c in dict.fromkeys((*required, *columns)) if c not in frame.columns]
    if missing:
        raise QKGeomError(f"{path}: not a qkgeom table (no {', '.join(map(repr, missing))} "
                          "column)")
    for col, kind in kinds.items():
        if col in frame.columns and not _kind_ok(frame[col], kind):
            raise QKGeomError(f"{path}: column {col!r} must hold {_KIND_WORDS[kind]}, but it "
                              f"is {frame[col].dtype}; the file is corrupt or not qkgeom's")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_keys(record: Any, path: Path, keys: dict[str, tuple[tuple[type, ...], bool]],
                what: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise QKGeomError(f"{path}: not {what} (a JSON object is expected, got "
                          f"{type(record).__name__})")
    for key, (types_, required) in keys.items():
        if key not in record:
            if required:
                raise QKGeomError(f"{path}: not {what} (no {key!r})")
            continue
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, types_) or (
                isinstance(value, float) and not math.isfinite(value)):
            words = " or ".join(_TYPE_WORDS.get(t, t.__name__) for t in types_)
            raise QKGeomError(f"{path}: {key!r} is {_short(value)}, not {words}; the file is "
                              "corrupt or not qkgeom's")
    return record


def check_status(record: Any, path: Path, states: tuple[str, ...]) -> dict[str, Any]:
    """``status.json`` as qkgeom writes it (a known state, a whole-number step ...)."""
    record = _check_keys(record, path, STATUS_KEYS, "a qkgeom run status")
    if record["state"] not in states:
        raise QKGeomError(f"{path}: state {_short(record['state'])} is not one of "
                          f"{', '.join(states)}")
    if record["step"] < 0 or record.get("steps", 0) < 0:
        raise QKGeomError(f"{path}: a negative step; the file is corrupt or not qkgeom's")
    return record


def check_sweep_record(record: Any, path: Path) -> dict[str, Any]:
    """``sweep.json`` as ``qkgeom sweep run`` writes it: a ``grid`` mapping and a list of
    run entries, each run in ``runs/<run_id>/``. Anything else (an older shape: runs as a
    mapping, bare ids, an entry naming its own folder) is refused, so that no sweep record
    can point a reader outside the sweep folder."""
    refuse = (f"{path}: not a sweep record of this qkgeom ({{}}); it reads the sweep.json "
              "that `qkgeom sweep run` writes: run the grid again into a new folder, or read "
              "it with the qkgeom version that wrote it")
    if not isinstance(record, dict):
        raise QKGeomError(refuse.format(f"a JSON object is expected, got "
                                        f"{type(record).__name__}"))
    for key, kind in (("grid", dict), ("runs", list)):
        if not isinstance(record.get(key), kind):
            word = "a mapping" if kind is dict else "a list of runs"
            raise QKGeomError(refuse.format(f"{key!r} must be {word}"))
    for entry in record["runs"]:
        if not isinstance(entry, dict):
            raise QKGeomError(refuse.format(f"a run entry is {_short(entry)}, not a mapping"))
        _check_keys(entry, path, SWEEP_RUN_KEYS, "a qkgeom sweep record (a run entry)")
        rid = entry["run_id"]
        placed = next((k for k in ("dir", "out_dir", "path") if k in entry), None)
        if placed:
            raise QKGeomError(refuse.format(f"run {rid[:40]!r} names its own folder "
                                            f"({placed!r}); runs live in runs/<run_id>/"))
        if not rid or rid in (".", "..") or any(c in rid for c in "/\\\0"):
            raise QKGeomError(f"{path}: run id {rid[:40]!r} is not a folder name; the file "
                              "is corrupt or not qkgeom's")
    return record


def check_alerts(record: Any, path: Path) -> list[dict[str, Any]]:
    """``alerts.json``: a list of alert mappings."""
    if not isinstance(record, list) or not all(isinstance(a, dict) for a in record):
        raise QKGeomError(f"{path}: not a qkgeom alerts record (a JSON list of alerts is "
                          f"expected, got {type(record).__name__})")
    return record
