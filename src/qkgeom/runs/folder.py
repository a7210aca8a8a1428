"""File names, format version, config record, status and tables of a run folder.

::

    RUN/
      config.json         the run record: config, its hash, data, vocabulary, versions
      metrics.parquet     run_id, step, layer, head (−1 = layer), metric, value
      train_log.parquet   step, loss, val_loss, lr, tokens_per_s
      status.json         state (running | done | diverged | failed), step, steps, wall time
      checkpoints/        ckpt_<step:08d>.pt, the newest few
      alerts.json         monitor runs: alerts that fired

Format 2 nests the key-control settings (``config.key_control.mode`` ...); a format-1
record (flat ``key_control``, ``key_control_scope``, ``shrink_to`` ...) is read as format 2.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QKGeomError
from qkgeom.io import read_json, write_json
from qkgeom.version import __version__

if TYPE_CHECKING:
    import pandas as pd

    from qkgeom.config import TrainConfig

FORMAT_VERSION = 2
CONFIG = "config.json"
METRICS = "metrics.parquet"
TRAIN_LOG = "train_log.parquet"
STATUS = "status.json"
ALERTS = "alerts.json"
KEY_PR = "key_pr.parquet"  # step, unit, pr: per-step key PR (key_control.record)
CHECKPOINTS = "checkpoints"
METRIC_COLUMNS = ["run_id", "step", "layer", "head", "metric", "value"]
LOG_COLUMNS = ["step", "loss", "val_loss", "lr", "tokens_per_s"]
FINAL_STATES = ("done", "diverged", "failed")
_CHECKPOINT = re.compile(r"ckpt_(\d{8})\.pt")
# Format 1 kept the key-control settings flat in the config: old name -> nested name.
_V1_KEY_CONTROL = {"key_control": "mode", "key_control_scope": "scope",
                   "key_control_how": "how", "shrink_to": "shrink_to", "expand_to": "expand_to"}


# ----------------------------------------------------------------------------- the record


def run_record(cfg: TrainConfig | None, run_id: str, **facts: Any) -> dict[str, Any]:
    """The ``config.json`` record of a run: ``cfg`` and its hash (``None``: a run whose
    config qkgeom cannot know, e.g. a monitored run it could not map) plus ``facts`` (data
    folder, source, vocabulary, ...), the format version and the software versions."""
    import torch

    known = {"config": cfg.to_dict(), "config_hash": cfg.config_hash()} if cfg else {"config": {}}
    return {"run_id": run_id, **known, **facts, "format_version": FORMAT_VERSION,
            "versions": {"qkgeom": __version__, "torch": torch.__version__,
                         "python": platform.python_version()}}


def _migrate(record: dict[str, Any]) -> dict[str, Any]:
    """A format-1 record as format 2 (the key-control settings nested)."""
    cfg = dict(record["config"])
    if not isinstance(cfg.get("key_control", {}), dict):
        nested = {new: cfg.pop(old) for old, new in _V1_KEY_CONTROL.items() if old in cfg}
        cfg["key_control"] = nested
    return {**record, "config": cfg, "format_version": FORMAT_VERSION}


def read_record(run: str | Path) -> dict[str, Any]:
    """The run's ``config.json``, checked and brought to the current format.

    Raises QKGeomError (one line) for a missing, torn, foreign or newer-format file."""
    path = Path(run) / CONFIG
    record = read_json(path)
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise QKGeomError(f"{path}: not a qkgeom run record (no 'config' mapping); the file "
                          "is corrupt or from another tool")
    version = record.get("format_version", 1)
    if version == 1:
        return _migrate(record)
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        advice = ("upgrade qkgeom to read it" if newer else
                  "read it with the qkgeom version that wrote it, or train it again")
        raise QKGeomError(f"{path}: run folder format {version!r}, this qkgeom reads formats "
                          f"1-{FORMAT_VERSION}; {advice}")
    return record


def load_config(run: str | Path) -> TrainConfig:
    """The :class:`~qkgeom.config.TrainConfig` a run folder was trained with."""
    from qkgeom.config import from_dict

    record = read_record(run)
    try:
        return from_dict(record["config"])
    except QKGeomError as err:
        raise QKGeomError(f"{Path(run) / CONFIG}: not a usable run config ({err})") from None


def is_run_folder(path: str | Path) -> bool:
    """A folder with a run record (ours, a sweep's or a monitor's)."""
    return (Path(path) / CONFIG).is_file() and any(
        (Path(path) / name).exists() for name in (METRICS, STATUS, CHECKPOINTS))


def claim_run_dir(out: Path, record: dict[str, Any], resume: bool) -> None:
    """Write ``record`` as ``out``'s config.json, refusing to clobber another run.

    A fresh run needs an empty or missing folder. Resuming needs the same config (compared
    by hash, after reading an older format) and a vocabulary with the same characters."""
    cfg_path = out / CONFIG
    if cfg_path.exists():
        if not resume:
            raise QKGeomError(f"{out} already holds a run; pass --resume to continue it "
                              "or choose another --out")
        saved = read_record(out)
        if saved.get("vocab_sha256", record["vocab_sha256"]) != record["vocab_sha256"]:
            meta = Path(record["data_dir"]) / "meta.json"
            raise QKGeomError(f"{meta}: its vocabulary is not the one this run was trained "
                              f"with ({cfg_path} records {saved.get('data_dir')}); resume with "
                              "--data pointing at that data, or train into a new --out")
        saved_hash = load_config(out).config_hash()
        if saved_hash != record["config_hash"]:
            raise QKGeomError(f"{cfg_path}: the run was started with a different config "
                              f"(hash {saved_hash} vs {record['config_hash']}); resume with "
                              "the same settings or use another --out")
    elif out.exists() and any(out.iterdir()) and not resume:
        raise QKGeomError(f"{out} exists and is not empty; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    write_json(cfg_path, record)


# ----------------------------------------------------------------------------- status


def read_status(run: str | Path) -> dict[str, Any] | None:
    """The run's status.json, or None when it has none (never started) or it is unreadable.

    An unreadable status (atomic writes never leave one; a user may edit it) reads as "never
    finished": a sweep then resumes the run from its newest checkpoint, cheap and safe."""
    path = Path(run) / STATUS
    if not path.exists():
        return None
    try:
        status = read_json(path)
    except QKGeomError:
        return None
    return status if isinstance(status, dict) else None


# ----------------------------------------------------------------------------- tables


def read_table(path: Path, upto: int | None = None,
               columns: tuple[str, ...] = ("step",)) -> pd.DataFrame | None:
    """A run table (rows with ``step <= upto``), None when the file does not exist.
    A torn or foreign file is a one-line QKGeomError naming it."""
    import pandas as pd

    if not path.exists():
        return None
    try:
        frame = pd.read_parquet(path)
    except Exception as err:
        raise QKGeomError(f"{path}: unreadable Parquet ({type(err).__name__}); delete the run "
                          "folder and train again") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise QKGeomError(f"{path}: not a qkgeom table (no {', '.join(map(repr, missing))} "
                          "column)")
    return frame if upto is None else frame[frame["step"] <= upto]


def read_metrics(run: str | Path, upto: int | None = None) -> pd.DataFrame | None:
    """``metrics.parquet`` (long format, :data:`METRIC_COLUMNS`), or None."""
    return read_table(Path(run) / METRICS, upto, ("step", "layer", "head", "metric", "value"))


def read_log(run: str | Path, upto: int | None = None) -> pd.DataFrame | None:
    """``train_log.parquet`` (:data:`LOG_COLUMNS`), or None."""
    return read_table(Path(run) / TRAIN_LOG, upto)


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_dir(run: str | Path) -> Path:
    return Path(run) / CHECKPOINTS


def checkpoint_path(run: str | Path, step: int) -> Path:
    return checkpoint_dir(run) / f"ckpt_{step:08d}.pt"


def list_checkpoints(run: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file (exact name ``ckpt_<8 digits>.pt``), oldest first."""
    folder = checkpoint_dir(run)
    if not folder.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in folder.iterdir()
                  if (m := _CHECKPOINT.fullmatch(p.name)))


def remove_stale_temp_files(run: str | Path) -> None:
    """Delete ``.NAME.*.tmp`` files a killed atomic write left in the run folder.

    Only called when a run resumes, i.e. by the one process that now owns the folder."""
    for folder in (Path(run), checkpoint_dir(run)):
        if folder.is_dir():
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
