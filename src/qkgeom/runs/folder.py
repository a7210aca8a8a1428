"""File names, format version, config record, status and tables of a run folder.

The layout is in docs/definitions.md#run-folder. One format is read (:data:`FORMAT_VERSION`;
an older folder is refused in one line). qkgeom writes into a folder only when it is new,
empty, or a qkgeom run folder holding nothing but its own entries and no symbolic link
(:func:`claim_run_dir`), so ``--resume`` never overwrites a file qkgeom did not write.
Every file is checked against its schema when read (:mod:`.schema`).
"""

from __future__ import annotations

import platform
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QKGeomError
from qkgeom.io import read_json, refuse_links, temp_name_pattern, write_json
from qkgeom.runs import table
from qkgeom.runs.schema import check_alerts, check_status
from qkgeom.runs.sweep import ATTEMPTS_FILE, ERROR_LOG, WORKER_LOG
from qkgeom.version import __version__

if TYPE_CHECKING:
    import pandas as pd

    from qkgeom.config import TrainConfig

FORMAT_VERSION = 5
CONFIG = "config.json"
METRICS = "metrics.parquet"
TRAIN_LOG = "train_log.parquet"
STATUS = "status.json"
ALERTS = "alerts.json"
KEY_PR = "key_pr.parquet"  # step, unit, pr: per-step key PR (key_control.record)
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tensorboard"  # event files of `qkgeom train --report-to tensorboard`
REPORT = "report"
METRIC_COLUMNS = ["run_id", "step", "layer", "head", "metric", "value"]
LOG_COLUMNS = ["step", "loss", "val_loss", "lr", "tokens_per_s"]
FINAL_STATES = ("done", "diverged", "failed")
# interrupted: stopped by a signal (SIGINT, SIGTERM), resumable like a killed "running"
STATES = ("running", "interrupted", *FINAL_STATES)
_CHECKPOINT = re.compile(r"ckpt_(\d{8})\.pt")
_OWN_FILES = frozenset({CONFIG, METRICS, TRAIN_LOG, STATUS, ALERTS, KEY_PR, ATTEMPTS_FILE,
                        WORKER_LOG, ERROR_LOG})
_OWN_DIRS = frozenset({CHECKPOINTS, REPORT, TENSORBOARD, table.parts_dir(METRICS).name,
                       table.parts_dir(TRAIN_LOG).name})
# The temp files of qkgeom's own atomic writes in a run folder, its checkpoints and parts.
_TEMP = temp_name_pattern("|".join(re.escape(n) for n in sorted(_OWN_FILES))
                          + r"|ckpt_\d{8}\.pt|p\d{10}-L\d+\.parquet")


def run_record(cfg: TrainConfig | None, run_id: str, **facts: Any) -> dict[str, Any]:
    """The ``config.json`` record of a run: ``cfg`` and its hash (``None``: a monitored run
    qkgeom could not map), ``facts`` (data, vocabulary, ...), the format and versions."""
    import torch

    known = {"config": cfg.to_dict(), "config_hash": cfg.config_hash()} if cfg else {"config": {}}
    return {"run_id": run_id, **known, **facts, "format_version": FORMAT_VERSION,
            "versions": {"qkgeom": __version__, "torch": torch.__version__,
                         "python": platform.python_version()}}


def read_record(run: str | Path) -> dict[str, Any]:
    """The run's ``config.json``, checked: a one-line QKGeomError for a missing, torn or
    foreign file, or one of another format (no ``format_version``: format 1)."""
    path = Path(run) / CONFIG
    record = read_json(path)
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise QKGeomError(f"{path}: not a qkgeom run record (no 'config' mapping); the file "
                          "is corrupt or from another tool")
    version = record.get("format_version", 1)
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise QKGeomError(
            f"{path}: written by a newer qkgeom (run folder format {version!r}); this qkgeom "
            f"reads format {FORMAT_VERSION}: upgrade qkgeom to read it" if newer else
            f"{path}: written by an older qkgeom (run folder format {version!r}); this qkgeom "
            f"reads format {FORMAT_VERSION} only: train it again with this version, or read "
            "it with the qkgeom version that wrote it")
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
    path = Path(path)
    return (path / CONFIG).is_file() and ((path / STATUS).exists() or (path / CHECKPOINTS)
                                          .exists() or table.exists(path / METRICS))


def foreign_entries(run: str | Path, *, check_status: bool = True) -> list[str]:
    """Names in ``run`` that qkgeom did not write there (sorted): anything but the run
    folder's own entries, a sweep's bookkeeping and qkgeom's temp files; a symbolic link is
    never qkgeom's. ``check_status``: a ``status.json`` that is not a qkgeom status counts
    too (beside a run record it is that run's damaged status, which a resume rewrites)."""
    run = Path(run)
    if not run.is_dir():
        return []
    foreign = []
    for entry in run.iterdir():
        name = entry.name
        own = not entry.is_symlink() and (
            (name in _OWN_FILES and entry.is_file()) or (name in _OWN_DIRS and entry.is_dir())
            or (_TEMP.fullmatch(name) is not None and entry.is_file()))
        if name == STATUS and own and check_status:  # a status qkgeom wrote (its schema)
            own = status_of(run)[0] is not None
        if not own:
            foreign.append(name)
    return sorted(foreign)


def _refuse_foreign(out: Path, foreign: list[str]) -> None:
    if not foreign:
        return
    shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
    raise QKGeomError(f"{out}: holds files qkgeom did not write ({shown}); --resume continues "
                      "only a qkgeom run folder and never overwrites other files: choose "
                      "another --out")


def _config_change(saved: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: old -> new`` for every setting that differs between two config dicts."""
    out = []
    for key in sorted(set(saved) | set(new)):
        a, b = saved.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_change(a, b, f"{prefix}{key}.")
        elif a != b and key not in ("device", "threads", "compile", "precision"):
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def claim_run_dir(out: Path, record: dict[str, Any], resume: bool) -> None:
    """Write ``record`` as ``out``'s config.json, refusing to clobber anything else
    (:func:`check_run_dir` first)."""
    check_run_dir(out, record, resume)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / CONFIG, record)


def check_run_dir(out: Path, record: dict[str, Any], resume: bool) -> None:
    """Whether ``record``'s run may be written into ``out``; a one-line QKGeomError if not
    (reads only). A fresh run needs an empty or missing folder; a resume a qkgeom run folder
    (or one holding only a sweep's files) with nothing foreign and no link in it, the same
    config hash, vocabulary and (where both record one) corpus."""
    cfg_path = out / CONFIG
    if out.exists() and not out.is_dir():
        raise QKGeomError(f"{out} exists and is not a folder; choose another --out")
    if out.is_dir() and resume:
        refuse_links(out)
    if cfg_path.exists():
        if not resume:
            raise QKGeomError(f"{out} already holds a run; pass --resume to continue it "
                              "or choose another --out")
        saved = read_record(out)
        _refuse_foreign(out, foreign_entries(out, check_status=False))
        _refuse_other_run(out, saved, record)
    elif out.exists() and any(out.iterdir()):
        if not resume:
            raise QKGeomError(f"{out} exists and is not empty; choose another --out")
        _refuse_foreign(out, foreign_entries(out))


def _refuse_other_run(out: Path, saved: dict[str, Any], record: dict[str, Any]) -> None:
    """A resume of ``out`` (recording ``saved``) with ``record``: the same vocabulary,
    corpus (where both record one) and config hash, else one line saying what changed."""
    cfg_path = out / CONFIG
    if saved.get("vocab_sha256", record["vocab_sha256"]) != record["vocab_sha256"]:
        meta = Path(record["data_dir"]) / "meta.json"
        raise QKGeomError(f"{meta}: its vocabulary is not the one this run was trained "
                          f"with ({cfg_path} records {saved.get('data_dir')}); resume with "
                          "--data pointing at that data, or train into a new --out")
    corpus = record.get("corpus_sha256")
    if corpus and saved.get("corpus_sha256", corpus) != corpus:
        meta = Path(record["data_dir"]) / "meta.json"
        raise QKGeomError(f"{meta}: the corpus is not the one this run was trained on "
                          f"(corpus_sha256 {str(saved.get('corpus_sha256'))[:12]} in "
                          f"{cfg_path}, {corpus[:12]} now; was the data prepared again?); "
                          "resume with --data pointing at that corpus, or train into a "
                          "new --out")
    saved_cfg = load_config(out)
    if saved_cfg.config_hash() == record["config_hash"]:
        return
    changes = _config_change(saved_cfg.to_dict(), record["config"])
    what = "; ".join(changes[:4]) or f"hash {saved_cfg.config_hash()} vs {record['config_hash']}"
    if any(c.startswith("steps:") for c in changes):
        raise QKGeomError(
            f"{cfg_path}: the run was started with a different config ({what}); a run cannot "
            "be lengthened on resume: its LR schedule decays to its own last step and its last "
            "probe and checkpoint fall there, so a longer run is not this run continued: "
            f"resume with --steps {saved_cfg.steps}, or train the longer run into a new --out")
    raise QKGeomError(f"{cfg_path}: the run was started with a different config ({what}); "
                      "resume with the same settings or use another --out")


def status_of(run: str | Path) -> tuple[dict[str, Any] | None, str]:
    """``(status, problem)``: the run's status.json checked against its schema; ``(None,
    "")`` when it has none, ``(None, reason naming the file)`` when it is not qkgeom's."""
    path = Path(run) / STATUS
    if not path.exists() and not path.is_symlink():
        return None, ""
    try:
        return check_status(read_json(path), path, STATES), ""
    except QKGeomError as err:
        return None, str(err)


def read_status(run: str | Path) -> dict[str, Any] | None:
    """The run's status.json, or None when it has none or it is not qkgeom's (atomic writes
    never leave one torn): "never finished", so a sweep resumes the run, cheap and safe."""
    return status_of(run)[0]


def finished_state(status: dict[str, Any] | None, retry_failed: bool = False) -> str | None:
    """The state of a run not to train again (the skip rule of every sweep path), or None:
    ``done``; ``diverged`` (a result, not retried); ``failed`` unless ``retry_failed``.
    Anything else (no status, ``running`` with nobody holding it, ``interrupted``) resumes."""
    state = (status or {}).get("state")
    return state if state in FINAL_STATES and not (state == "failed" and retry_failed) else None


def read_alerts(run: str | Path) -> list[dict[str, Any]]:
    """The alerts a monitored run recorded (``alerts.json``; [] when it has none); a file
    that is not a list of alerts is a one-line QKGeomError naming it."""
    path = Path(run) / ALERTS
    if not path.exists():
        return []
    return check_alerts(read_json(path), path)


def read_table(path: Path, upto: int | None = None,
               columns: tuple[str, ...] = ("step",)) -> pd.DataFrame | None:
    """A run table with its parts (rows with ``step <= upto``), None when there is neither;
    a torn or foreign file is a one-line QKGeomError naming it."""
    frame = table.read(path, columns)
    if frame is None or upto is None:
        return frame
    return frame[frame["step"] <= upto].reset_index(drop=True)


def read_metrics(run: str | Path, upto: int | None = None, *, wide: bool = False,
                 missing_ok: bool = False) -> pd.DataFrame | None:
    """``metrics.parquet`` (long format, :data:`METRIC_COLUMNS`) with its parts: every probe
    a run recorded so far (rows with ``step <= upto``). ``wide``: one row per ``(run_id,
    step, layer, head)`` with the metrics as columns. A missing folder, or one with no probe
    recorded, is a one-line QKGeomError naming the path (a typo surfaces here, not as a
    TypeError later); ``missing_ok``: None instead (a live view polling a run that has
    not probed yet)."""
    run = Path(run)
    frame = read_table(run / METRICS, upto, ("step", "layer", "head", "metric", "value"))
    if frame is None:
        if missing_ok:
            return None
        raise QKGeomError(_no_metrics(run))
    return wide_metrics(frame) if wide else frame


def _no_metrics(run: Path) -> str:
    """Why ``run`` has no metrics to read, naming the path (and a close sibling folder)."""
    if not run.is_dir():
        import difflib

        parent = run.parent if run.parent.is_dir() else None
        siblings = [p.name for p in parent.iterdir() if p.is_dir()] if parent else []
        close = difflib.get_close_matches(run.name, siblings, n=1, cutoff=0.6)
        hint = f"; did you mean {parent / close[0]}?" if close and parent else ""
        return f"{run}: no such run folder{hint}"
    if not (run / CONFIG).is_file():
        return f"{run / METRICS}: not found; {run} is not a qkgeom run folder"
    return f"{run / METRICS}: not found; the run has recorded no probe yet"


def wide_metrics(metrics: pd.DataFrame) -> pd.DataFrame:
    """Long metrics (:data:`METRIC_COLUMNS`) as one row per ``(run_id, step, layer, head)``
    with one column per metric (NaN where a metric has no value at that row: layer-only
    metrics on head rows), in step, layer, head order."""
    keys = ["run_id", "step", "layer", "head"]
    long = metrics.assign(run_id=metrics["run_id"].astype(str),
                          metric=metrics["metric"].astype(str))
    out = (long.groupby([*keys, "metric"], sort=True, observed=True)["value"].last()
           .unstack("metric").reset_index())
    out.columns.name = None
    return out


def read_log(run: str | Path, upto: int | None = None) -> pd.DataFrame | None:
    """``train_log.parquet`` (:data:`LOG_COLUMNS`) with its newer rows, or None."""
    return read_table(Path(run) / TRAIN_LOG, upto)


def has_metrics(run: str | Path) -> bool:
    """Whether the run has recorded any probe (``metrics.parquet`` or its parts)."""
    return table.exists(Path(run) / METRICS)


def checkpoint_dir(run: str | Path) -> Path:
    return Path(run) / CHECKPOINTS


def checkpoint_path(run: str | Path, step: int) -> Path:
    return checkpoint_dir(run) / f"ckpt_{step:08d}.pt"


def list_checkpoints(run: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file (``ckpt_<8 digits>.pt``, not a link), oldest
    first."""
    return table.numbered_files(checkpoint_dir(run), _CHECKPOINT)


def remove_stale_temp_files(run: str | Path) -> list[Path]:
    """Delete (and return) the temp files a killed atomic write of qkgeom left in the run
    folder, its checkpoints and table parts: only names qkgeom's own writes use (a user's
    ``*.tmp`` is not ours). Called on resume, by the process holding the run's lock."""
    run = Path(run)
    removed = []
    for folder in (run, checkpoint_dir(run), table.parts_dir(run / METRICS),
                   table.parts_dir(run / TRAIN_LOG)):
        if folder.is_dir() and (folder == run or not folder.is_symlink()):
            for tmp in folder.iterdir():
                if _TEMP.fullmatch(tmp.name) and tmp.is_file() and not tmp.is_symlink():
                    tmp.unlink(missing_ok=True)
                    removed.append(tmp)
    return removed
