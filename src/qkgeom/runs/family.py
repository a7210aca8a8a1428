"""The folder of a checkpoint-family analysis (experiment E4), written by
:func:`qkgeom.checkpoints.analyze_checkpoints` and read by the E4 report, and the E4 set of
such folders, one per seed (``qkgeom reproduce e4``). Their layouts: docs/checkpoints.md.
"""

from __future__ import annotations

from pathlib import Path

from qkgeom.errors import QKGeomError
from qkgeom.io import read_json, write_json

MARKER = "analysis.json"
FORMAT_VERSION = 1
CHECKPOINT_TABLE = "checkpoints.parquet"
CACHE = "checkpoints"


def is_analysis_folder(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def record_text_shortfall(path: str | Path) -> str | None:
    """When the text ran out before the ``max_tokens`` an analysis asked for: record it in
    ``analysis.json`` (``text_ran_out``: tokens asked for and analysed) and return a
    one-line warning; None when every checkpoint got the tokens it asked for."""
    import pandas as pd

    folder = Path(path)
    meta = read_json(folder / MARKER)
    table = folder / CHECKPOINT_TABLE
    if not isinstance(meta, dict) or not table.is_file():
        return None
    asked = int(meta.get("settings", {}).get("max_tokens", 0))
    try:
        got = int(pd.read_parquet(table, columns=["tokens"])["tokens"].min())
    except Exception as err:
        raise QKGeomError(f"{table}: unreadable ({type(err).__name__})") from None
    if got >= asked:
        return None
    write_json(folder / MARKER, {**meta, "text_ran_out": {"max_tokens": asked, "tokens": got}})
    text = meta.get("settings", {}).get("text")
    return (f"the text {text!r} ran out after {got:,} tokens, fewer than the {asked:,} asked "
            f"for (--tokens); every checkpoint was analysed on those {got:,} tokens (recorded "
            f"in {folder / MARKER})")


# --- a set of analysis folders, one per seed (``qkgeom reproduce e4``) --------------------

SET_MARKER = "e4.json"
SET_KIND = "qkgeom-e4-seeds"


def is_e4_set(path: str | Path) -> bool:
    """A folder of analysis folders, one per seed, marked by ``e4.json``."""
    return (Path(path) / SET_MARKER).is_file()


def e4_set_units(path: str | Path) -> dict[str, Path]:
    """``{label: analysis folder}`` of an E4 set, in the marker's order. Each folder is a
    plain relative path inside the set (no ``..``, not absolute) that holds an analysis;
    anything else is a one-line :class:`QKGeomError`."""
    folder = Path(path)
    meta = read_json(folder / SET_MARKER)
    units = meta.get("units") if isinstance(meta, dict) else None
    if not (isinstance(meta, dict) and meta.get("kind") == SET_KIND and isinstance(units, dict)
            and units and all(isinstance(k, str) and isinstance(v, str)
                              for k, v in units.items())):
        raise QKGeomError(f"{folder / SET_MARKER}: not a qkgeom E4 set (kind {SET_KIND!r} and "
                          "units {label: folder} expected)")
    out = {}
    for label, rel in units.items():
        parts = Path(rel).parts
        if not parts or Path(rel).is_absolute() or ".." in parts:
            raise QKGeomError(f"{folder / SET_MARKER}: unit {label!r} points outside the set "
                              f"({rel!r})")
        unit = folder / rel
        if not is_analysis_folder(unit):
            raise QKGeomError(f"{unit}: the E4 set's unit {label!r} is not an analysis folder "
                              f"(no {MARKER}); run `qkgeom reproduce e4` again to finish it")
        out[label] = unit
    return out
