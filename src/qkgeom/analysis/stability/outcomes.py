"""What each run of a stability sweep came to (docs/stability.md#what-is-measured-per-run):
its final val loss, entropy and max logit, whether it collapsed, when its loss departed
from the stable run of its seed, and whether its remedy acted.

Diverged runs stay in (a divergence is a collapse); failed and unfinished runs are listed
as left out. The remedy of a run is the arm ``sweep.json`` records for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.analysis.collate import runs_table
from qkgeom.errors import QKGeomError
from qkgeom.runs import read_log, read_metrics
from qkgeom.runs.sweep import read_sweep_record

STABLE_LR = 3e-3  # the small training preset's lr: departures and S2 are measured at it
COLLAPSE_NATS = 0.4  # a layer below this mean entropy at the last probe: collapsed
DEPARTURE_NATS = 0.05  # val loss this far above the stable run of the seed: departed
ACTED_RTOL = 0.01  # hold: achieved PR within 1 % of its target at every probe
NONE = "none"

RUN_COLUMNS = ["run_id", "arm", "lr", "seed", "state", "diverged_step", "steps",
               "final_val_loss", "final_entropy", "min_entropy", "final_logit_max",
               "peak_logit_max", "collapsed", "departure_step", "acted"]


@dataclass
class StabilityRuns:
    """A stability sweep read once: one row per analysed run (:data:`RUN_COLUMNS`), the
    layer rows of their metrics (``run_id, step, layer, metric, value``), their
    validation losses (``run_id, step, val_loss``), the runs left out with the reason,
    and the stable learning rate (the smallest of the sweep)."""

    runs: pd.DataFrame
    layers: pd.DataFrame
    val: pd.DataFrame
    left_out: pd.DataFrame
    stable_lr: float
    name: str


def read_stability(folder: str | Path) -> StabilityRuns:
    """Read a stability sweep folder (``qkgeom reproduce stability``)."""
    folder = Path(folder)
    table = runs_table(folder)
    arms = {str(r.get("run_id")): (r.get("axes") or {}).get("arm")
            for r in read_sweep_record(folder).get("runs", []) if isinstance(r, dict)}
    keep = table["state"].isin(["done", "diverged"]) & table["run_id"].map(arms).notna()
    left_out = table.loc[~keep, ["run_id", "state"]].assign(
        reason=np.where(table.loc[~keep, "run_id"].map(arms).isna(), "no arm in sweep.json",
                        "not finished (" + table.loc[~keep, "state"].astype(str) + ")"))
    rows, layers, vals = [], [], []
    for r in table[keep].itertuples():
        metrics, log = read_metrics(r.dir), read_log(r.dir)
        if metrics is None or log is None:
            left_out.loc[len(left_out)] = [r.run_id, r.state, "no metrics or training log"]
            continue
        lay = metrics[metrics["head"] == -1][["step", "layer", "metric", "value"]]
        layers.append(lay.assign(run_id=r.run_id))
        vals.append(log[["step", "val_loss"]].dropna().assign(run_id=r.run_id))
        rows.append({"run_id": r.run_id, "arm": arms[r.run_id], "lr": float(r.lr),
                     "seed": int(r.seed), "state": r.state, "steps": int(r.steps),
                     "diverged_step": _diverged_step(r.dir, r.state)})
    if not rows:
        raise QKGeomError(f"{folder}: no finished run of a stability sweep to report")
    return stability_runs(pd.DataFrame(rows), pd.concat(layers, ignore_index=True),
                          pd.concat(vals, ignore_index=True), left_out.reset_index(drop=True),
                          folder.name)


def stability_runs(runs: pd.DataFrame, layers: pd.DataFrame, val: pd.DataFrame,
                   left_out: pd.DataFrame, name: str) -> StabilityRuns:
    """The outcomes of runs given as tables: ``runs`` (``run_id, arm, lr, seed, state,
    steps, diverged_step``), ``layers`` (``run_id, step, layer, metric, value``), ``val``
    (``run_id, step, val_loss``)."""
    stab = StabilityRuns(runs, layers, val, left_out, float(runs["lr"].min()), name)
    stab.runs = _outcomes(stab)[RUN_COLUMNS]
    return stab


def _diverged_step(run_dir: str, state: str) -> float:
    from qkgeom.runs import read_status

    status = read_status(run_dir) or {}
    step = status.get("diverged_step")
    return float(step) if state == "diverged" and isinstance(step, int) else np.nan


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
    runs.loc[runs["state"] == "diverged", "final_val_loss"] = np.nan
    runs["collapsed"] = (runs["state"] == "diverged") | (runs["min_entropy"] < COLLAPSE_NATS)
    runs["departure_step"] = _departures(stab, runs)
    runs["acted"] = [_acted(stab, run_id, arm) for run_id, arm in runs["arm"].items()]
    return runs.reset_index()


def _departures(stab: StabilityRuns, runs: pd.DataFrame) -> pd.Series:
    """First validation step at which a run's val loss exceeds the stable ``none`` run of
    its seed by more than :data:`DEPARTURE_NATS`; a diverged run departs at its divergence
    at the latest; NaN: never (or no stable run to compare with)."""
    stable = runs[(runs["arm"] == NONE) & np.isclose(runs["lr"], stab.stable_lr)]
    ref = {seed: stab.val[stab.val["run_id"] == rid].set_index("step")["val_loss"]
           for rid, seed in stable["seed"].items()}
    out = pd.Series(np.nan, index=runs.index)
    for run_id, r in runs.iterrows():
        if r["seed"] not in ref:
            continue
        mine = stab.val[stab.val["run_id"] == run_id].set_index("step")["val_loss"]
        excess = (mine - ref[r["seed"]]).dropna()
        over = excess.index[(excess > DEPARTURE_NATS) | ~np.isfinite(excess)]
        out[run_id] = np.fmin(float(over.min()) if len(over) else np.nan, r["diverged_step"])
    return out


def _acted(stab: StabilityRuns, run_id: str, arm: str) -> bool:
    """Whether the remedy's control acted (docs/stability.md#claims-and-statistics):
    ``hold`` on target at every probe, ``entropy_target`` with its setpoints recorded at
    every probe; structural remedies always act."""
    mine = stab.layers[stab.layers["run_id"] == run_id]
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
