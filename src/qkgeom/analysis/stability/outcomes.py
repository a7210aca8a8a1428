"""What each run of a stability sweep came to (docs/stability.md#what-is-measured-per-run):
its initial and final val loss, final entropy and max logit, whether it collapsed, when its
loss departed from the stable run of its seed and size, and whether its remedy acted.

Diverged runs stay in (a divergence is a collapse); failed and unfinished runs are listed
as left out. The remedy of a run is the arm ``sweep.json`` records for it, its size the
size it records (one size: named from the model's shape), its LR warm-up its config's
``warmup_steps`` (what the growth-rate rules after the warm-up, C3w and C4w, read from).
Hugging Face trial folders (monitor runs with ``trial.family``, ``trial.lr``,
``trial.seed`` in their config) read into the same shape: arm ``none``, the family as the
size, the warm-up ``trial.warmup_steps`` (else ``config.warmup_steps``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from qkgeom.analysis.collate import runs_table
from qkgeom.errors import QKGeomError
from qkgeom.runs import read_log, read_metrics, read_record, read_status
from qkgeom.runs.sweep import read_sweep_record, sweep_experiment

STABLE_LR = 3e-3  # the small training preset's lr: departures and S2 are measured at it
COLLAPSE_NATS = 0.4  # a layer below this mean entropy at the last probe: collapsed
DEPARTURE_NATS = 0.05  # val loss this far above the stable run of the seed: departed
ACTED_RTOL = 0.01  # hold: achieved PR within 1 % of its target at every probe
NONE = "none"
#: Protocol 1's arm names, read as the variants they are (docs/stability.md#remedies).
OLD_ARMS = {"sigma_reparam": "sigma_reparam_qk"}
TRIAL_KEYS = ("family", "lr", "seed")  # config.json ``trial`` of a Hugging Face trial run

RUN_COLUMNS = ["run_id", "arm", "size", "lr", "seed", "state", "diverged_step", "steps",
               "warmup", "wall_s", "initial_val_loss", "final_val_loss", "final_entropy",
               "min_entropy", "final_logit_max", "peak_logit_max", "collapsed",
               "departure_step", "acted"]
LEFT_OUT_COLUMNS = ["run_id", "state", "reason"]


@dataclass
class StabilityRuns:
    """A stability sweep read once: one row per analysed run (:data:`RUN_COLUMNS`), the
    layer rows of their metrics (``run_id, step, layer, metric, value``), their
    validation losses (``run_id, step, val_loss``), the runs left out with the reason,
    and the stable learning rate (:data:`STABLE_LR` when the sweep has it, else its
    smallest)."""

    runs: pd.DataFrame
    layers: pd.DataFrame
    val: pd.DataFrame
    left_out: pd.DataFrame
    stable_lr: float
    name: str

    @property
    def sizes(self) -> list[str]:
        """The model sizes in the order the runs list them."""
        return list(dict.fromkeys(self.runs["size"]))

    @property
    def warmup(self) -> int:
        """The LR warm-up (steps) of every run: the rules after the warm-up (C3w, C4w)
        read from it, so runs of two warm-ups cannot share one rule set (one line)."""
        w = self.runs["warmup"].astype(float)
        if w.isna().any():
            rid = self.runs.loc[w.isna(), "run_id"].iloc[0]
            raise QKGeomError(f"{self.name}: run {rid} records no LR warm-up (warmup_steps), "
                              "which the growth-rate rules after the warm-up need")
        values = sorted({int(v) for v in w})
        if len(values) > 1:
            raise QKGeomError(f"{self.name}: runs of different LR warm-ups ("
                              + ", ".join(f"{v}" for v in values) + " steps); the rules "
                              "after the warm-up read one per folder: report each apart")
        return values[0] if values else 0


def read_stability(folder: str | Path) -> StabilityRuns:
    """Read a stability sweep folder (``qkgeom reproduce stability``)."""
    folder = Path(folder)
    table = runs_table(folder)
    axes = {str(r.get("run_id")): (r.get("axes") or {})
            for r in read_sweep_record(folder).get("runs", []) if isinstance(r, dict)}
    arms = {rid: a.get("arm") for rid, a in axes.items()}
    keep = table["state"].isin(["done", "diverged"]) & table["run_id"].map(arms).notna()
    left_out = table.loc[~keep, ["run_id", "state"]].assign(
        reason=np.where(table.loc[~keep, "run_id"].map(arms).isna(), "no arm in sweep.json",
                        "not finished (" + table.loc[~keep, "state"].astype(str) + ")"))
    rows: list[dict[str, Any]] = []
    for r in table[keep].itertuples():
        arm = str(arms[r.run_id])
        size = axes[r.run_id].get("size") or shape_name(r.depth, r.n_embd, r.block_size)
        rows.append({"run_id": r.run_id, "arm": OLD_ARMS.get(arm, arm), "size": str(size),
                     "lr": float(r.lr), "seed": int(r.seed), "state": r.state,
                     "steps": int(r.steps), "warmup": _number(r.config.get("warmup_steps")),
                     "dir": r.dir})
    return _read_runs(rows, left_out, folder.name)


def read_trials(folder: str | Path) -> StabilityRuns:
    """Read Hugging Face trial runs (a run folder, or a folder of them under ``runs/``):
    each a monitor run whose config.json holds ``trial.family``, ``trial.lr`` and
    ``trial.seed``; arm ``none``, the family as the size. A finished run whose val loss
    went non-finite counts as diverged."""
    folder = Path(folder)
    table = runs_table(folder)
    left_out = pd.DataFrame(columns=LEFT_OUT_COLUMNS)
    rows: list[dict[str, Any]] = []
    for r in table.itertuples():
        trial = _trial(r)
        if trial is None or r.state not in ("done", "diverged"):
            why = ("no trial.family, trial.lr, trial.seed in config.json" if trial is None
                   else f"not finished ({r.state})")
            left_out.loc[len(left_out)] = [r.run_id, r.state, why]
            continue
        rows.append({"run_id": r.run_id, "arm": NONE, "size": str(trial["family"]),
                     "lr": float(trial["lr"]), "seed": int(trial["seed"]), "state": r.state,
                     "steps": int(trial.get("steps") or r.steps),
                     "warmup": _trial_warmup(r, trial), "dir": r.dir})
    return _read_runs(rows, left_out, folder.name, diverge_on_nan=True)


def read_runs(folder: str | Path) -> StabilityRuns:
    """A stability sweep (its grid says so) or a folder of Hugging Face trial runs."""
    if sweep_experiment(folder) == "stability":
        return read_stability(folder)
    return read_trials(folder)


def shape_name(n_layer: Any, n_embd: Any, block_size: Any) -> str:
    """A model size named by its shape: ``4x128-ctx64``."""
    return f"{int(n_layer)}x{int(n_embd)}-ctx{int(block_size)}"


def _trial(row: Any) -> dict[str, Any] | None:
    """``trial.*`` of a run: from its flattened config, else the record's top level."""
    flat = row.config if isinstance(getattr(row, "config", None), dict) else {}
    trial = {k: flat.get(f"trial.{k}") for k in (*TRIAL_KEYS, "steps", "warmup_steps")}
    if any(trial[k] is None for k in TRIAL_KEYS):
        try:
            top = read_record(row.dir).get("trial")
        except (QKGeomError, OSError):
            top = None
        trial = top if isinstance(top, dict) else {}
    ok = all(trial.get(k) is not None for k in TRIAL_KEYS)
    return trial if ok else None


def _trial_warmup(row: Any, trial: dict[str, Any]) -> float:
    """A trial run's LR warm-up: ``trial.warmup_steps``, else the record's own
    ``config.warmup_steps`` (never a default: NaN when neither is recorded)."""
    if trial.get("warmup_steps") is not None:
        return _number(trial["warmup_steps"])
    try:
        config = read_record(row.dir).get("config")
    except (QKGeomError, OSError):
        config = None
    return _number(config.get("warmup_steps")) if isinstance(config, dict) else np.nan


def _read_runs(rows: list[dict[str, Any]], left_out: pd.DataFrame, name: str, *,
               diverge_on_nan: bool = False) -> StabilityRuns:
    """The metrics and logs of ``rows`` (each with its ``dir``) into one
    :class:`StabilityRuns`; a run without them is left out."""
    runs, layers, vals = [], [], []
    for row in rows:
        metrics, log = read_metrics(row["dir"], missing_ok=True), read_log(row["dir"])
        if metrics is None or log is None or "val_loss" not in log:
            left_out.loc[len(left_out)] = [row["run_id"], row["state"],
                                           "no metrics or training log"]
            continue
        lay = metrics[metrics["head"] == -1][["step", "layer", "metric", "value"]]
        layers.append(lay.assign(run_id=row["run_id"]))
        val = log[log["val_loss"].notna()][["step", "val_loss"]]
        vals.append(val.assign(run_id=row["run_id"]))
        status = read_status(row["dir"]) or {}
        state = row["state"]
        bad = _non_finite_steps(log)
        if diverge_on_nan and state == "done" and len(bad):
            state = "diverged"
        diverged = status.get("diverged_step")
        runs.append({**{k: v for k, v in row.items() if k != "dir"}, "state": state,
                     "wall_s": _number(status.get("wall_s")),
                     "diverged_step": (float(diverged) if isinstance(diverged, int)
                                       else float(bad.min()) if len(bad) else np.nan)
                     if state == "diverged" else np.nan})
    if not runs:
        raise QKGeomError(f"{name}: no finished run of a stability sweep to report")
    return stability_runs(pd.DataFrame(runs), pd.concat(layers, ignore_index=True),
                          pd.concat(vals, ignore_index=True), left_out.reset_index(drop=True),
                          name)


def _non_finite_steps(log: pd.DataFrame) -> pd.Series:
    """Steps after 0 whose logged losses went non-finite: an infinite loss or val loss, or
    a row with neither loss finite (the step-0 row has no training loss by convention)."""
    loss = log["loss"].astype(float) if "loss" in log else pd.Series(np.nan, log.index)
    val = log["val_loss"].astype(float)
    bad = np.isinf(loss) | np.isinf(val) | (loss.isna() & val.isna())
    return log.loc[bad & (log["step"] > 0), "step"]


def _number(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else np.nan


def stability_runs(runs: pd.DataFrame, layers: pd.DataFrame, val: pd.DataFrame,
                   left_out: pd.DataFrame, name: str) -> StabilityRuns:
    """The outcomes of runs given as tables: ``runs`` (``run_id, arm, lr, seed, state,
    steps, diverged_step``, optionally ``size``, ``warmup`` (0 when absent) and
    ``wall_s``), ``layers`` (``run_id,
    step, layer, metric, value``), ``val`` (``run_id, step, val_loss``)."""
    runs = runs.copy()
    if "size" not in runs:
        runs["size"] = "model"
    if "wall_s" not in runs:
        runs["wall_s"] = np.nan
    if "warmup" not in runs:
        runs["warmup"] = 0.0
    stab = StabilityRuns(runs, layers, val, left_out, stable_lr(runs["lr"]), name)
    stab.runs = _outcomes(stab)[RUN_COLUMNS]
    return stab


def stable_lr(lrs: pd.Series) -> float:
    """The stable learning rate of a sweep: :data:`STABLE_LR` when it has it, else its
    smallest."""
    lrs = lrs.astype(float)
    return STABLE_LR if np.isclose(lrs, STABLE_LR).any() else float(lrs.min())


def layer_table(stab: StabilityRuns, metric: str) -> pd.DataFrame:
    """``run_id, step, layer, value`` of one layer-level metric."""
    rows = stab.layers[stab.layers["metric"] == metric]
    return rows[["run_id", "step", "layer", "value"]]


def _outcomes(stab: StabilityRuns) -> pd.DataFrame:
    """The per-run numbers of the protocol, added to ``stab.runs``."""
    runs = stab.runs.set_index("run_id")
    ent = layer_table(stab, "attn_entropy")
    last = ent[ent["step"] == ent.groupby("run_id")["step"].transform("max")]
    runs["final_entropy"] = last.groupby("run_id")["value"].mean()
    runs["min_entropy"] = last.groupby("run_id")["value"].min()
    peak = layer_table(stab, "logit_max")
    last_peak = peak[peak["step"] == peak.groupby("run_id")["step"].transform("max")]
    runs["final_logit_max"] = last_peak.groupby("run_id")["value"].max()
    runs["peak_logit_max"] = peak.groupby("run_id")["value"].max()
    final = stab.val[stab.val["step"] == stab.val["run_id"].map(runs["steps"])]
    runs["final_val_loss"] = final.set_index("run_id")["val_loss"]
    first = stab.val[stab.val["step"] == 0]
    runs["initial_val_loss"] = first.groupby("run_id")["val_loss"].first()
    runs.loc[runs["state"] == "diverged", "final_val_loss"] = np.nan
    runs["collapsed"] = (runs["state"] == "diverged") | (runs["min_entropy"] < COLLAPSE_NATS)
    runs["departure_step"] = _departures(stab, runs)
    by_run = dict(tuple(stab.layers.groupby("run_id", sort=False)))
    empty = stab.layers.iloc[:0]
    runs["acted"] = [_acted(by_run.get(run_id, empty), arm) for run_id, arm in
                     runs["arm"].items()]
    return runs.reset_index()


def _departures(stab: StabilityRuns, runs: pd.DataFrame) -> pd.Series:
    """First validation step at which a run's val loss exceeds the stable ``none`` run of
    its seed and size by more than :data:`DEPARTURE_NATS`; a diverged run departs at its
    divergence at the latest; NaN: never (or no stable run to compare with)."""
    stable = runs[(runs["arm"] == NONE) & np.isclose(runs["lr"], stab.stable_lr)]
    val = {rid: g.set_index("step")["val_loss"] for rid, g in stab.val.groupby("run_id")}
    empty = pd.Series(dtype=float)
    ref = {(size, seed): val.get(rid, empty)
           for rid, size, seed in zip(stable.index, stable["size"], stable["seed"], strict=True)}
    out = pd.Series(np.nan, index=runs.index)
    for run_id, r in runs.iterrows():
        if (r["size"], r["seed"]) not in ref:
            continue
        mine = val.get(run_id, empty)
        excess = (mine - ref[(r["size"], r["seed"])]).dropna()
        over = excess.index[(excess > DEPARTURE_NATS) | ~np.isfinite(excess)]
        out[run_id] = np.fmin(float(over.min()) if len(over) else np.nan, r["diverged_step"])
    return out


def _acted(mine: pd.DataFrame, arm: str) -> bool:
    """Whether the remedy's control acted (docs/stability.md#claims-and-statistics), from
    the layer rows of its run: ``hold`` on target at every probe, ``entropy_target`` with
    its setpoints recorded at every probe; structural remedies always act."""
    if arm not in ("hold", "entropy_target"):
        return True
    probes = set(mine.loc[mine["metric"] == "attn_entropy", "step"])
    if arm == "hold":
        ctl = mine[mine["metric"].str.match(r"ctl_(pr|target)_l\d+$")]
        if ctl.empty:
            return not (probes - {0})
        wide = ctl.assign(kind=ctl["metric"].str.split("_").str[1],
                          unit=ctl["metric"].str.rsplit("_", n=1).str[1])
        wide = wide.pivot_table(index=["step", "unit"], columns="kind", values="value")
        off = (wide["pr"] / wide["target"] - 1).abs()
        return bool((off <= ACTED_RTOL).all()) and set(wide.index.get_level_values(0)) >= (
            probes - {0})
    if arm == "entropy_target":
        recorded = set(mine.loc[mine["metric"].str.startswith("ctl_setpoint_l"), "step"])
        return recorded >= probes
    return True
