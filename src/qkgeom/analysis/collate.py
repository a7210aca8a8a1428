"""Collate a sweep folder into one long table, and seed-average it into trajectories.

A sweep folder holds ``sweep.json`` and ``runs/<run_id>/`` run folders (layout:
docs/definitions.md). Every fact the analysis needs (depth, Q/K init, seed, warm-up,
reference step) is read from each run's own ``config.json``, so the analysis works whatever
``sweep.json`` records, on a bare folder of runs, and on one run folder. Runs that did not
finish (``diverged``, ``failed``, still ``running``, or with no metrics) are left out of
every average and listed, with the reason, by :func:`excluded_runs`. So is a run
whose files are unreadable or of the wrong types (checked against their schemas,
:mod:`qkgeom.runs.schema`): one bad run never sinks the report. A run folder that
``sweep.json`` places outside the sweep folder (``"dir": "/abs/run"``, ``../x``) is
listed as unreadable and never read.

Trajectory: a metric against training step for one (run, layer[, head]); a seed-averaged
trajectory averages runs that differ only by seed. Runs that differ in any
other config value besides depth and Q/K init get a ``variant`` label (e.g.
``"lr=0.001"``) so they are never averaged together.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from qkgeom.config import TrainConfig, check_config_types, flatten
from qkgeom.errors import QKGeomError
from qkgeom.runs import (
    has_metrics,
    is_run_folder,
    read_log,
    read_metrics,
    read_record,
    status_of,
)
from qkgeom.runs.sweep import read_sweep_record

# Group keys of a seed-averaged trajectory (one per layer).
GROUP = ["depth", "qk_init", "variant"]
TRAJECTORY = [*GROUP, "layer"]
COLUMNS = ["run_id", "depth", "qk_init", "variant", "seed", "state", "step", "layer", "head",
           "metric", "value"]
# Config values that never define a variant: the seed axis, the grid axes themselves, and
# where/how a run was executed.
_NOT_VARIANT = {"seed", "model.n_layer", "model.qk_init", "device", "threads", "data",
                "log_every", "eval_every", "eval_batches", "checkpoint_every",
                "keep_checkpoints", "probe_batch"}
# How fast, not what (left out of the config hash too): runs differing only in these pair.
_EXECUTION = {"device", "threads", "compile"}
CONTROL_PREFIX = "key_control."
MONITOR_SOURCE = "qkgeom.monitor"  # the "source" a GeometryMonitor writes into config.json


_DEFAULT_FLAT = flatten(TrainConfig().to_dict())


def _sweep_entries(sweep_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``sweep.json`` (or {}) and the run entries it lists, each with ``run_id`` and ``dir``.

    The sweep runner writes ``{"grid": {"name", "preset", "base", "axes"}, "runs": [{"run_id",
    "axes", "config_hash", "steps"}]}``; a list of ids or a {run_id: axes} mapping is read too.
    """
    spec: dict[str, Any] = {}
    entries: list[dict[str, Any]] = []
    if is_single_run(sweep_dir):
        return spec, [{"run_id": sweep_dir.resolve().name, "dir": sweep_dir, "axes": {}}]
    if (sweep_dir / "sweep.json").exists():
        spec = read_sweep_record(sweep_dir)  # its schema, else one line naming it
        listed = spec.get("runs") or []
        if isinstance(listed, dict):  # {run_id: axes} or {run_id: {...}}
            listed = [{"run_id": k, **(v if isinstance(v, dict) and "axes" in v else
                                       {"axes": v if isinstance(v, dict) else {}})}
                      for k, v in listed.items()]
        for run in listed:
            if isinstance(run, str):
                run = {"run_id": run}
            if not isinstance(run, dict):
                continue
            rid = run.get("run_id")
            if not rid:
                continue
            where = run.get("dir") or run.get("out_dir") or run.get("path")
            # A listed folder is relative to the sweep folder; the default one already is.
            folder = sweep_dir / str(where) if where else sweep_dir / "runs" / rid
            axes = run.get("axes", {})
            entry = {"run_id": rid, "dir": folder, "axes": axes if isinstance(axes, dict) else {}}
            if where and not _inside(sweep_dir, str(where)):
                entry["refused"] = (f"unreadable run: {sweep_dir / 'sweep.json'} places it at "
                                    f"{str(where)[:80]!r}, outside the sweep folder; not read")
            elif folder.is_symlink():
                entry["refused"] = f"unreadable run: {folder} is a symbolic link; not read"
            entries.append(entry)
    listed = {e["dir"].resolve() for e in entries}
    runs_dir = sweep_dir / "runs"
    if runs_dir.is_dir():  # folders sweep.json does not (yet) list
        for folder in sorted(p for p in runs_dir.iterdir() if (p / "config.json").exists()):
            if folder.is_symlink():  # someone else's run folder, linked in: never read
                if all(e["dir"] != folder for e in entries):
                    entries.append({"run_id": folder.name, "dir": folder, "axes": {},
                                    "refused": f"unreadable run: {folder} is a symbolic "
                                               "link; not read"})
            elif folder.resolve() not in listed:
                entries.append({"run_id": folder.name, "dir": folder, "axes": {}})
    return spec, entries


def _inside(sweep_dir: Path, where: str) -> bool:
    """Whether ``where`` (a folder sweep.json lists) is a relative path that stays inside
    the sweep folder, links resolved."""
    rel = Path(where)
    if rel.is_absolute() or ".." in rel.parts:
        return False
    root = sweep_dir.resolve()
    return (sweep_dir / rel).resolve().is_relative_to(root)


def is_single_run(folder: str | Path) -> bool:
    """A run folder given on its own (no ``sweep.json``): collated as a sweep of one run."""
    folder = Path(folder)
    return is_run_folder(folder) and not (folder / "sweep.json").exists()


def runs_table(sweep_dir: str | Path) -> pd.DataFrame:
    """One row per run of the sweep: identity, config facts (:func:`_config_facts`), state,
    and why it is left out (``excluded``: ``""`` = included, else the reason).

    ``source`` is who wrote the run: ``"qkgeom.monitor"`` for a
    :class:`~qkgeom.monitor.GeometryMonitor`, which did not build its model, so ``model`` and
    ``qk_init`` hold the model's class (a pretrained model has no init); ``ref_step`` is
    :attr:`TrainConfig.ref_step`; runs with equal ``pair_key`` differ only in their key
    control (and device/threads/compile), with equal ``cell_key`` also in their seed;
    ``started``/``ended`` come from ``status.json`` (seconds since the epoch), and
    ``train_seconds`` (time in training steps: tokens over logged throughput) and the final
    losses from the training log."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise QKGeomError(f"{sweep_dir}: not a folder")
    _, entries = _sweep_entries(sweep_dir)
    if not entries:
        raise QKGeomError(f"{sweep_dir}: no runs found (expected sweep.json or runs/<id>/config.json)")
    rows, flat_cfgs = zip(*(_run_row(entry) for entry in entries), strict=True)
    table = pd.DataFrame(list(rows))
    table["variant"] = _variants(list(flat_cfgs))
    dup = table["run_id"].duplicated(keep="first")
    table.loc[dup, "excluded"] = "duplicate run_id"
    return table


def _run_row(entry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run's row of :func:`runs_table` and its flattened config ({} for a run that is
    not read: refused, not started, or unreadable, each with its reason)."""
    folder: Path = entry["dir"]
    row: dict[str, Any] = {"run_id": entry["run_id"], "dir": str(folder), "excluded": ""}
    if entry.get("refused"):
        return {**row, "state": "unreadable", "excluded": entry["refused"]}, {}
    if not (folder / "config.json").exists():
        axes = entry["axes"]
        return {**row, "state": "pending", "excluded": "not started (no config.json)",
                "depth": axes.get("model.n_layer"), "qk_init": axes.get("model.qk_init"),
                "seed": axes.get("seed")}, {}
    try:
        prov = read_record(folder)
        try:  # the values of the types a config has (a monitor's may be {})
            check_config_types(prov["config"])
        except QKGeomError as err:
            raise QKGeomError(f"{folder / 'config.json'}: {err}") from None
    except QKGeomError as err:  # one unreadable run is listed, never sinks the report
        return {**row, "state": "unreadable", "excluded": f"unreadable run: {err}"}, {}
    # A field a run's config lacks (written by an older qkgeom) has its default value,
    # so adding a config field never splits one setting into two variants.
    flat = {**_DEFAULT_FLAT, **flatten(prov.get("config", {}))}
    try:  # record facts of the wrong types: this run is unreadable, not the report
        row.update(_config_facts(prov, entry["run_id"], flat))
    except (TypeError, ValueError, AttributeError) as err:
        return {**row, "state": "unreadable", "excluded": f"unreadable run: "
                f"{folder / 'config.json'}: a value of the wrong type "
                f"({' '.join(str(err).split())[:100]})"}, {}
    row["tokens"] = row["steps"] * row["batch_size"] * row["block_size"]
    _add_state(row, folder)
    return row, flat


def _config_facts(prov: dict[str, Any], run_id: str, flat: dict[str, Any]) -> dict[str, Any]:
    """The facts of one run's record (its config, else the model facts a monitor
    recorded); a value of the wrong type raises TypeError or ValueError."""
    cfg = prov.get("config", {})
    facts = prov.get("model") if isinstance(prov.get("model"), dict) else {}
    known = {"n_layer": facts.get("n_layer"), "n_head": facts.get("n_head"),
             "n_embd": facts.get("d_model")}
    model = {**{k: v for k, v in known.items() if v is not None}, **cfg.get("model", {})}
    monitored = prov.get("source") == MONITOR_SOURCE
    warmup, steps = int(cfg.get("warmup_steps", 0)), int(cfg.get("steps", 0))
    # the one rule (TrainConfig.ref_step): explicit reference_step, else 25 % of steps
    ref = TrainConfig.ref_step_of(steps, int(cfg.get("reference_step", -1)))
    return {
        "run_id": prov.get("run_id", run_id), "depth": int(model.get("n_layer", 0)),
        "qk_init": _model_name(facts) if monitored else str(model.get("qk_init", "?")),
        "seed": int(cfg.get("seed", 0)), "steps": steps, "warmup_steps": warmup,
        "ref_step": ref, "batch_size": int(cfg.get("batch_size", 0)),
        "block_size": int(model.get("block_size", 0)), "n_embd": int(model.get("n_embd", 0)),
        "n_head": int(model.get("n_head", 0)), "bias": bool(model.get("bias", False)),
        "lr": cfg.get("lr"), "probe_every": cfg.get("probe_every"),
        "probe_sequences": cfg.get("probe_sequences"),
        "vocab_size": int(prov.get("vocab_size", model.get("vocab_size", 0))),
        "data_source": str(prov.get("data_source") or cfg.get("data") or "?"),
        "config_hash": prov.get("config_hash", ""),
        # E3 pairs runs by these (qkgeom.analysis.e3.arms)
        "key_control": str(flat.get("key_control.mode", "none")),
        "control": {k.removeprefix(CONTROL_PREFIX): v for k, v in flatten(cfg).items()
                    if k.startswith(CONTROL_PREFIX)},
        "pair_key": _digest(flat, _EXECUTION), "cell_key": _digest(flat, _EXECUTION | {"seed"}),
        "source": str(prov.get("source") or ""), "n_params": facts.get("n_params", np.nan),
        "model": _model_name(facts) if monitored else "",
    }


def _add_state(row: dict[str, Any], folder: Path) -> None:
    """The run's state, step and times from ``status.json``, why it is left out (if it
    is), and its training log's facts, into ``row``."""
    status, problem = _read_status(folder / "status.json")
    state = status.get("state", "unknown")
    row.update(state=state, step=status.get("step"), started=status.get("started"),
               ended=status.get("updated"))
    if state in ("diverged", "failed"):
        where = status.get("diverged_step", status.get("step"))
        msg = status.get("error") or status.get("message") or ""
        row["excluded"] = f"{state} at step {where}" + (f": {msg}" if msg else "")
    elif problem:
        row["excluded"] = problem
    elif state != "done":
        row["excluded"] = (f"incomplete ({state}, step {status.get('step', '?')}/{row['steps']})"
                           if status else "incomplete (no status.json)")
    elif not has_metrics(folder):
        row["excluded"] = "no metrics.parquet"
    try:
        log = read_log(folder)
    except QKGeomError as err:
        row["excluded"] = row["excluded"] or f"unreadable training log ({err})"
        return
    if log is not None:
        row.update(_log_facts(log, row["batch_size"] * row["block_size"]))


def _model_name(facts: dict[str, Any]) -> str:
    """What a monitored run watched: its model's class (the monitor did not build the
    model, so its Q/K init is not known; a pretrained model has none)."""
    return str(facts.get("class") or facts.get("arch") or "monitored model")


def _digest(flat: dict[str, Any], leave_out: set[str]) -> str:
    """A short hash of the config values except ``key_control.*`` and ``leave_out``: runs
    with equal digests differ only in their key control (and in what was left out)."""
    kept = {k: v for k, v in flat.items()
            if k not in leave_out and not k.startswith(CONTROL_PREFIX)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _read_status(path: Path) -> tuple[dict[str, Any], str]:
    """``(status, problem)``: a missing file is ``({}, "")``; a torn or foreign one, or one
    of the wrong types, is ``({}, reason)``, so the run is listed as left out instead of
    failing the report."""
    status, problem = status_of(path.parent)
    if problem:
        return {}, f"unreadable {path.name} ({problem.split(': ', 1)[-1]})"
    return status or {}, ""


def _log_facts(log: pd.DataFrame, tokens_per_step: int) -> dict[str, float]:
    out = {"train_seconds": np.nan, "final_val_loss": np.nan, "final_loss": np.nan}
    if log.empty:
        return out
    log = log.sort_values("step")
    tps = log["tokens_per_s"].to_numpy(dtype=float)
    dsteps = np.diff(log["step"].to_numpy(dtype=float), prepend=0.0)
    ok = np.isfinite(tps) & (tps > 0)
    out["train_seconds"] = float(np.sum(dsteps[ok] * tokens_per_step / tps[ok]))
    val = log["val_loss"].dropna()
    loss = log["loss"].dropna()
    out["final_val_loss"] = float(val.iloc[-1]) if len(val) else np.nan
    out["final_loss"] = float(loss.iloc[-1]) if len(loss) else np.nan
    return out


def _variants(flat_cfgs: list[dict[str, Any]]) -> list[str]:
    """Label each run by the config values (other than depth, init, seed) that vary."""
    keys = sorted({k for f in flat_cfgs for k in f} - _NOT_VARIANT)
    varying = [k for k in keys
               if len({repr(f.get(k)) for f in flat_cfgs if f}) > 1]
    return [",".join(f"{k.removeprefix('model.')}={f.get(k)}" for k in varying) if f else ""
            for f in flat_cfgs]


def collate(sweep_dir: str | Path, include_incomplete: bool = False) -> pd.DataFrame:
    """All included runs' metrics in one long table.

    Columns ``run_id, depth, qk_init, variant, seed, state, step, layer, head, metric,
    value`` (``depth`` = n_layer). ``table.attrs`` carries ``"runs"`` (the
    :func:`runs_table` rows as records), ``"excluded"`` (records of the runs left out, with
    ``run_id, state, excluded`` = the reason) and ``"sweep"`` (``sweep.json`` or {}).
    ``include_incomplete`` keeps runs still ``running`` (never diverged or failed ones).
    """
    sweep_dir = Path(sweep_dir)
    spec, _ = _sweep_entries(sweep_dir)
    runs = runs_table(sweep_dir)
    if include_incomplete:
        partial = runs["excluded"].str.startswith("incomplete (running")
        runs.loc[partial, "excluded"] = ""
    frames = []
    for row in runs[runs["excluded"] == ""].itertuples():
        try:  # metrics.parquet with the probes written since its last compaction
            m = read_metrics(row.dir)
            why = "" if m is not None else "no file"
        except QKGeomError as err:  # names the torn or mistyped file and why
            m, why = None, str(err).split(";")[0]
        if m is None or why:
            runs.loc[row.Index, "excluded"] = f"unreadable metrics.parquet ({why})"
            continue
        m = m.assign(run_id=row.run_id, depth=row.depth, qk_init=row.qk_init,
                     variant=row.variant, seed=row.seed, state=row.state)
        frames.append(m[COLUMNS])
    if frames:
        table = pd.concat(frames, ignore_index=True)
    else:
        table = pd.DataFrame({c: pd.Series(dtype=float if c == "value" else object)
                              for c in COLUMNS})
    for col in ("depth", "seed", "step", "layer", "head"):
        table[col] = table[col].astype("int64")
    table["metric"] = table["metric"].astype(str)
    table.attrs["runs"] = _records(runs)
    left_out = runs.reindex(columns=[*runs.columns, *(c for c in ("depth", "qk_init", "seed")
                                                       if c not in runs.columns)])
    table.attrs["excluded"] = _records(  # every run may be unreadable: no depth column then
        left_out.loc[left_out["excluded"] != "", ["run_id", "depth", "qk_init", "seed",
                                                  "state", "excluded"]])
    table.attrs["sweep"] = spec
    table.attrs["name"] = sweep_name(spec, sweep_dir)
    return table


def sweep_name(spec: dict[str, Any], sweep_dir: Path) -> str:
    grid = spec.get("grid") if isinstance(spec.get("grid"), dict) else {}
    return str(spec.get("name") or grid.get("name") or Path(sweep_dir).resolve().name)


def sweep_axes(spec: dict[str, Any]) -> dict[str, list[Any]]:
    """The grid's axes from ``sweep.json`` ({} if it records none)."""
    grid = spec.get("grid")
    if not isinstance(grid, dict):
        return {}
    axes = grid.get("axes", grid)  # the runner nests them; a flat mapping is accepted too
    if not isinstance(axes, dict):
        return {}
    return {str(k): (v if isinstance(v, list) else [v]) for k, v in axes.items()
            if k not in ("name", "preset", "base")}


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Plain-Python records (attrs must stay cheap to copy and JSON-friendly)."""
    out = []
    for rec in frame.to_dict("records"):
        out.append({k: (None if isinstance(v, float) and np.isnan(v) else
                        v.item() if isinstance(v, np.generic) else v) for k, v in rec.items()})
    return out


def bare(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of a collated ``table`` without its ``attrs``. pandas deep-copies ``attrs``
    into every frame derived from a table (each filter, merge, groupby), which with a
    sweep's run records costs more than the statistics themselves: compute on this."""
    out = table.copy(deep=False)
    out.attrs = {}
    return out


# What collate() attaches to its table is read through these four functions only.


def runs_of(table: pd.DataFrame) -> pd.DataFrame:
    """The per-run facts :func:`collate` attached to ``table`` (all runs, excluded too)."""
    return pd.DataFrame(table.attrs.get("runs", []))


def excluded_runs(table: pd.DataFrame) -> pd.DataFrame:
    """The runs :func:`collate` left out, with ``state`` and the reason (``excluded``)."""
    return pd.DataFrame(table.attrs.get("excluded", []),
                        columns=["run_id", "depth", "qk_init", "seed", "state", "excluded"])


def sweep_of(table: pd.DataFrame) -> tuple[str | None, dict[str, Any]]:
    """``(name, sweep.json)`` of the folder :func:`collate` read (None and {} when the
    table carries neither)."""
    return table.attrs.get("name"), table.attrs.get("sweep") or {}


def ref_steps(table: pd.DataFrame) -> dict[str, int]:
    """Each run's configured reference step (:attr:`TrainConfig.ref_step`), from the run
    facts :func:`collate` attached (runs without one left out)."""
    return {r["run_id"]: int(r["ref_step"]) for r in table.attrs.get("runs", [])
            if r.get("ref_step") is not None}


def trajectories(table: pd.DataFrame, metric: str, head: int | None = -1,
                 level: float = 0.95) -> pd.DataFrame:
    """Seed-averaged trajectories of ``metric``: one row per (depth, qk_init, variant,
    layer, step) with ``mean, ci_low, ci_high, sd, n_seeds``.

    The CI is the two-sided ``level`` t-interval over seeds (scipy.stats.t); with one seed
    ``ci_low``/``ci_high``/``sd`` are NaN. ``head=-1`` (default) is the whole layer;
    ``head=None`` keeps every head as its own trajectory (a ``head`` column) — note head
    indices are not matched across seeds, so per-head seed means are rarely meaningful.
    """
    sel = table[table["metric"] == metric]
    keys = [*TRAJECTORY, "step"]
    if head is None:
        keys = [*TRAJECTORY, "head", "step"]
    else:
        sel = sel[sel["head"] == head]
    cols = [*keys, "mean", "ci_low", "ci_high", "sd", "n_seeds"]
    if sel.empty:
        return pd.DataFrame(columns=cols)
    values = sel[np.isfinite(sel["value"])]
    grouped = values.groupby(keys, sort=True)["value"]
    out = grouped.agg(mean="mean", sd="std", n_seeds="count").reset_index()
    n = out["n_seeds"].to_numpy()
    tcrit = np.full(len(out), np.nan)
    many = n >= 2
    from scipy import stats as sst  # the report extra; collate itself needs pandas only

    tcrit[many] = sst.t.ppf(0.5 + level / 2, n[many] - 1)
    half = tcrit * out["sd"].to_numpy() / np.sqrt(np.maximum(n, 1))
    out["ci_low"] = out["mean"] - half
    out["ci_high"] = out["mean"] + half
    out.loc[~many, "sd"] = np.nan
    out["metric"] = metric
    return out[[*cols, "metric"]]
