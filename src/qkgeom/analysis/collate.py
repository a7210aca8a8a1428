"""Collate a result folder (a sweep, a bare folder of runs, one run folder) into one typed
:class:`Collated`, and seed-average its metrics into trajectories.

Every fact is read from each run's own ``config.json``, so the analysis works whatever
``sweep.json`` records. A run that did not finish, or whose files are unreadable or of the
wrong types, is left out of every number and listed with the reason: one bad run never
sinks the report. Layout and reasons: docs/definitions.md, docs/report.md#what-is-analysed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from qkgeom.config import TrainConfig, check_config_types, flatten
from qkgeom.errors import QKGeomError
from qkgeom.runs import has_metrics, is_run_folder, read_log, read_metrics, read_record, status_of
from qkgeom.runs.sweep import read_sweep_record

# Group keys of a seed-averaged trajectory (one per layer).
GROUP = ["depth", "qk_init", "variant"]
TRAJECTORY = [*GROUP, "layer"]
COLUMNS = ["run_id", "depth", "qk_init", "variant", "seed", "state", "step", "layer", "head",
           "metric", "value"]
EXCLUDED_COLUMNS = ["run_id", "depth", "qk_init", "seed", "state", "excluded"]
# Config values that never define a variant: the seed axis, the grid axes themselves, and
# where/how a run was executed.
_NOT_VARIANT = {"seed", "model.n_layer", "model.qk_init", "device", "threads", "data",
                "log_every", "eval_every", "eval_batches", "checkpoint_every",
                "keep_checkpoints", "probe_batch"}
MONITOR_SOURCE = "qkgeom.monitor"  # the "source" a GeometryMonitor writes into config.json
_DEFAULT_FLAT = flatten(TrainConfig().to_dict())


@dataclass(frozen=True)
class Collated:
    """What :func:`collate` read: ``metrics`` (the included runs' long table, columns
    :data:`COLUMNS`), ``runs`` (:func:`runs_table`, excluded runs too), ``sweep``
    (``sweep.json`` or {}), the folder's ``name`` and path. A dataclass rather than
    ``DataFrame.attrs``, which pandas drops or deep-copies on most operations."""

    metrics: pd.DataFrame
    runs: pd.DataFrame
    sweep: dict[str, Any]
    name: str
    folder: Path

    @property
    def included(self) -> pd.DataFrame:
        """The rows of :attr:`runs` in the numbers."""
        return self.runs[self.runs["excluded"] == ""] if len(self.runs) else self.runs

    @property
    def excluded(self) -> pd.DataFrame:
        """The runs left out (:data:`EXCLUDED_COLUMNS`; ``excluded`` is the reason)."""
        runs = self.runs.reindex(columns=[*self.runs.columns, *(
            c for c in EXCLUDED_COLUMNS if c not in self.runs.columns)])
        return runs.loc[runs["excluded"] != "", EXCLUDED_COLUMNS].reset_index(drop=True)

    @property
    def ref_steps(self) -> dict[str, int]:
        """Each included run's reference step (:attr:`TrainConfig.ref_step`)."""
        inc = self.included
        return dict(zip(inc["run_id"], inc["ref_step"].astype(int), strict=True)) \
            if len(inc) else {}


def is_single_run(folder: str | Path) -> bool:
    """A run folder given on its own (no ``sweep.json``): collated as a sweep of one run."""
    folder = Path(folder)
    return is_run_folder(folder) and not (folder / "sweep.json").exists()


def _sweep_entries(sweep_dir: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs of a folder, each ``{run_id, dir, axes[, refused]}``: those ``sweep.json``
    lists (its one shape, checked when read: every run in ``runs/<run_id>/``), then any
    ``runs/*/`` it does not list; a run folder that is a symbolic link is never read."""
    if is_single_run(sweep_dir):
        return [{"run_id": sweep_dir.resolve().name, "dir": sweep_dir, "axes": {}}]
    listed = {r["run_id"]: r.get("axes") or {} for r in spec.get("runs") or []}
    runs_dir = sweep_dir / "runs"
    found = sorted(p.name for p in runs_dir.iterdir() if (p / "config.json").exists()) \
        if runs_dir.is_dir() else []
    entries = []
    for rid in [*listed, *(r for r in found if r not in listed)]:
        folder = runs_dir / rid
        refused = (f"unreadable run: {folder} is a symbolic link; not read"
                   if folder.is_symlink() else "")
        entries.append({"run_id": rid, "dir": folder, "axes": listed.get(rid, {}),
                        "refused": refused})
    return entries


def runs_table(sweep_dir: str | Path) -> pd.DataFrame:
    """One row per run of the folder: identity, config facts (:func:`_config_facts`),
    ``config`` (the flattened config, defaults filled in), state, times, and ``excluded``
    (``""`` = in the numbers, else why not)."""
    return _read(Path(sweep_dir))[1]


def _read(sweep_dir: Path) -> tuple[dict[str, Any], pd.DataFrame]:
    """``(sweep.json or {}, runs_table)`` of ``sweep_dir``."""
    if not sweep_dir.is_dir():
        raise QKGeomError(f"{sweep_dir}: not a folder")
    spec = read_sweep_record(sweep_dir) if (sweep_dir / "sweep.json").exists() else {}
    entries = _sweep_entries(sweep_dir, spec)
    if not entries:
        raise QKGeomError(f"{sweep_dir}: no runs found (expected sweep.json or runs/<id>/config.json)")
    rows = [_run_row(entry) for entry in entries]
    table = pd.DataFrame(rows)
    table["variant"] = _variants([r.get("config", {}) for r in rows])
    table.loc[table["run_id"].duplicated(keep="first"), "excluded"] = "duplicate run_id"
    return spec, table


def _run_row(entry: dict[str, Any]) -> dict[str, Any]:
    """One run's row of :func:`runs_table` (without ``config`` for a run that is not
    read: refused, not started, or unreadable, each with its reason)."""
    folder: Path = entry["dir"]
    row: dict[str, Any] = {"run_id": entry["run_id"], "dir": str(folder), "excluded": ""}
    if entry.get("refused"):
        return {**row, "state": "unreadable", "excluded": entry["refused"]}
    if not (folder / "config.json").exists():
        axes = entry["axes"]
        return {**row, "state": "pending", "excluded": "not started (no config.json)",
                "depth": axes.get("model.n_layer"), "qk_init": axes.get("model.qk_init"),
                "seed": axes.get("seed")}
    try:
        prov = read_record(folder)
        try:  # the values of the types a config has (a monitor's may be {})
            check_config_types(prov["config"])
        except QKGeomError as err:
            raise QKGeomError(f"{folder / 'config.json'}: {err}") from None
        # A field an older run's config lacks has its default value, so adding a config
        # field never splits one setting into two variants.
        flat = {**_DEFAULT_FLAT, **flatten(prov.get("config", {}))}
        row.update(_config_facts(prov, entry["run_id"]), config=flat)
    except QKGeomError as err:  # one unreadable run is listed, never sinks the report
        return {**row, "state": "unreadable", "excluded": f"unreadable run: {err}"}
    except (TypeError, ValueError, AttributeError) as err:  # record facts of wrong types
        return {**row, "state": "unreadable", "excluded": f"unreadable run: "
                f"{folder / 'config.json'}: a value of the wrong type "
                f"({' '.join(str(err).split())[:100]})"}
    row["tokens"] = row["steps"] * row["batch_size"] * row["block_size"]
    _add_state(row, folder)
    return row


def _config_facts(prov: dict[str, Any], run_id: str) -> dict[str, Any]:
    """The facts of one run's record (its config, else the model facts a monitor
    recorded); a value of the wrong type raises TypeError or ValueError."""
    cfg = prov.get("config", {})
    facts = prov.get("model") if isinstance(prov.get("model"), dict) else {}
    known = {"n_layer": facts.get("n_layer"), "n_head": facts.get("n_head"),
             "n_embd": facts.get("d_model")}
    model = {**{k: v for k, v in known.items() if v is not None}, **cfg.get("model", {})}
    monitored = prov.get("source") == MONITOR_SOURCE
    # a monitor did not build its model: its class stands for the init (a pretrained
    # model has none)
    name = str(facts.get("class") or facts.get("arch") or "monitored model")
    steps = int(cfg.get("steps", 0))
    return {
        "run_id": prov.get("run_id", run_id), "depth": int(model.get("n_layer", 0)),
        "qk_init": name if monitored else str(model.get("qk_init", "?")),
        "seed": int(cfg.get("seed", 0)), "steps": steps,
        "warmup_steps": int(cfg.get("warmup_steps", 0)),
        "ref_step": TrainConfig.ref_step_of(steps, int(cfg.get("reference_step", -1))),
        "batch_size": int(cfg.get("batch_size", 0)),
        "block_size": int(model.get("block_size", 0)), "n_embd": int(model.get("n_embd", 0)),
        "n_head": int(model.get("n_head", 0)), "bias": bool(model.get("bias", False)),
        "lr": cfg.get("lr"), "probe_every": cfg.get("probe_every"),
        "probe_sequences": cfg.get("probe_sequences"),
        "vocab_size": int(prov.get("vocab_size", model.get("vocab_size", 0))),
        "data_source": str(prov.get("data_source") or cfg.get("data") or "?"),
        "config_hash": prov.get("config_hash", ""),
        "source": str(prov.get("source") or ""), "n_params": facts.get("n_params", np.nan),
        "model": name if monitored else "",
    }


def _add_state(row: dict[str, Any], folder: Path) -> None:
    """The run's state, step and times from ``status.json``, why it is left out (if it
    is), and its training log's facts, into ``row``."""
    status, problem = status_of(folder)
    status = {} if problem else status or {}
    row.update(state=status.get("state", "unknown"), step=status.get("step"),
               started=status.get("started"), ended=status.get("updated"))
    state = row["state"]
    if state in ("diverged", "failed"):
        where = status.get("diverged_step", status.get("step"))
        msg = status.get("error") or status.get("message") or ""
        row["excluded"] = f"{state} at step {where}" + (f": {msg}" if msg else "")
    elif problem:
        row["excluded"] = f"unreadable status.json ({problem.split(': ', 1)[-1]})"
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


def _log_facts(log: pd.DataFrame, tokens_per_step: int) -> dict[str, float]:
    """Time in training steps (tokens over logged throughput) and the final losses."""
    out = {"train_seconds": np.nan, "final_val_loss": np.nan, "final_loss": np.nan}
    if log.empty:
        return out
    log = log.sort_values("step")
    tps = log["tokens_per_s"].to_numpy(dtype=float)
    dsteps = np.diff(log["step"].to_numpy(dtype=float), prepend=0.0)
    ok = np.isfinite(tps) & (tps > 0)
    out["train_seconds"] = float(np.sum(dsteps[ok] * tokens_per_step / tps[ok]))
    for key, col in (("final_val_loss", "val_loss"), ("final_loss", "loss")):
        values = log[col].dropna()
        out[key] = float(values.iloc[-1]) if len(values) else np.nan
    return out


def _variants(flat_cfgs: list[dict[str, Any]]) -> list[str]:
    """Label each run by the config values (other than depth, init, seed) that vary."""
    keys = sorted({k for f in flat_cfgs for k in f} - _NOT_VARIANT)
    varying = [k for k in keys
               if len({repr(f.get(k)) for f in flat_cfgs if f}) > 1]
    return [",".join(f"{k.removeprefix('model.')}={f.get(k)}" for k in varying) if f else ""
            for f in flat_cfgs]


def collate(sweep_dir: str | Path, include_incomplete: bool = False) -> Collated:
    """Every run of ``sweep_dir`` (:func:`runs_table`) and the included runs' metrics in
    one long table (``depth`` = n_layer). ``include_incomplete`` keeps runs still
    ``running`` (never diverged or failed ones)."""
    sweep_dir = Path(sweep_dir)
    spec, runs = _read(sweep_dir)
    if include_incomplete:
        runs.loc[runs["excluded"].str.startswith("incomplete (running"), "excluded"] = ""
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
        frames.append(m.assign(run_id=row.run_id, depth=row.depth, qk_init=row.qk_init,
                               variant=row.variant, seed=row.seed, state=row.state)[COLUMNS])
    if frames:
        table = pd.concat(frames, ignore_index=True)
    else:
        table = pd.DataFrame({c: pd.Series(dtype=float if c == "value" else object)
                              for c in COLUMNS})
    table = table.astype({c: "int64" for c in ("depth", "seed", "step", "layer", "head")})
    table["metric"] = table["metric"].astype(str)
    grid = spec.get("grid") if isinstance(spec.get("grid"), dict) else {}
    name = str(spec.get("name") or grid.get("name") or sweep_dir.resolve().name)
    return Collated(table, runs, spec, name, sweep_dir)


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


def trajectories(table: Collated | pd.DataFrame, metric: str, head: int | None = -1,
                 level: float = 0.95) -> pd.DataFrame:
    """Seed-averaged trajectories of ``metric`` (of :func:`collate`'s result or its long
    table): one row per (depth, qk_init, variant, layer, step) with ``mean, ci_low,
    ci_high, sd, n_seeds``, the CI the two-sided ``level`` t-interval over seeds (NaN with
    one seed). ``head=None`` keeps every head as its own trajectory; head indices are not
    matched across seeds, so per-head seed means are rarely meaningful."""
    table = table.metrics if isinstance(table, Collated) else table
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
