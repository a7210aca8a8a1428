"""The alert rules measured on the runs they watch (docs/stability.md#alerts): thresholds
derived from calibration runs, then false alarms, precision, recall and lead time of the
rules replayed (:func:`qkgeom.alerts.replay`, the monitor's own logic) on a sweep.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from qkgeom.alerts import (
    DEFAULT_RULES,
    AlertRule,
    entropy_collapse,
    key_pr_drop,
    logit_growth,
    logit_jump,
    replay,
)
from qkgeom.analysis.stability.outcomes import NONE, StabilityRuns

ALERT_COLUMNS = ["run_id", "arm", "lr", "seed", "collapsed", "stable_none", "departure_step",
                 "alerted", "first_alert_step", "first_rule", "lead_steps"]


def _run_metrics(stab: StabilityRuns, run_id: str) -> pd.DataFrame:
    rows = stab.layers[stab.layers["run_id"] == run_id]
    return rows.assign(head=-1)[["step", "layer", "head", "metric", "value"]]


def _stable_none(stab: StabilityRuns) -> pd.DataFrame:
    runs = stab.runs
    return runs[(runs["arm"] == NONE) & np.isclose(runs["lr"], stab.stable_lr)]


def calibrate(stab: StabilityRuns) -> dict[str, float]:
    """The thresholds of docs/stability.md#alerts from the stable ``none`` runs of a
    calibration sweep: L = 2 × their largest layer ``logit_max``, D = 2 × their largest
    ``logit_delta``, E = ½ × their smallest layer ``attn_entropy`` after step 0."""
    ids = set(_stable_none(stab)["run_id"])
    lay = stab.layers[stab.layers["run_id"].isin(ids)]
    top = lay.groupby("metric")["value"].max()
    ent = lay[(lay["metric"] == "attn_entropy") & (lay["step"] > 0)]["value"]
    return {"logit_max": 2 * float(top.get("logit_max", np.nan)),
            "logit_delta": 2 * float(top.get("logit_delta", np.nan)),
            "attn_entropy": 0.5 * float(ent.min())}


def candidate_rules(thresholds: dict[str, float], steps: int) -> dict[str, AlertRule]:
    """The four candidates, by the metric they read (the key-PR rule from the first probe
    at or after 25 % of a run of ``steps``)."""
    return {"logit_max": logit_growth(_round(thresholds["logit_max"])),
            "logit_delta": logit_jump(_round(thresholds["logit_delta"])),
            "attn_entropy": entropy_collapse(_round(thresholds["attn_entropy"])),
            "pr_k_token": key_pr_drop(0.5, math.ceil(steps / 4))}


def _round(x: float) -> float:
    """Two significant digits: a threshold is a round number a user can read and type."""
    return float(f"{x:.2g}")


def evaluate(stab: StabilityRuns, rules: tuple[AlertRule, ...] = DEFAULT_RULES
             ) -> pd.DataFrame:
    """Per analysed run (:data:`ALERT_COLUMNS`): whether ``rules`` fired, the first alert
    and its rule, and the lead time = departure step − first alert step."""
    stable = set(_stable_none(stab)["run_id"])
    rows = []
    for r in stab.runs.itertuples():
        fired = replay(_run_metrics(stab, r.run_id), rules)
        first = min(fired, key=lambda a: (a.step, a.layer)) if fired else None
        step = float(first.step) if first else np.nan
        rows.append({"run_id": r.run_id, "arm": r.arm, "lr": r.lr, "seed": r.seed,
                     "collapsed": bool(r.collapsed), "stable_none": r.run_id in stable,
                     "departure_step": r.departure_step, "alerted": first is not None,
                     "first_alert_step": step, "first_rule": first.rule if first else "",
                     "lead_steps": r.departure_step - step})
    return pd.DataFrame(rows, columns=ALERT_COLUMNS)


def alert_summary(alerts: pd.DataFrame) -> dict[str, float]:
    """False alarms (on the stable ``none`` runs, and on every run that did not collapse),
    precision, recall, and the lead times of the alerted collapsed runs."""
    pos, hit = alerts["collapsed"], alerts["alerted"]
    leads = alerts.loc[pos & hit, "lead_steps"].dropna()
    stable = alerts["stable_none"]
    return {"stable_runs": int(stable.sum()), "stable_false_alarms": int((stable & hit).sum()),
            "healthy_runs": int((~pos).sum()), "false_alarms": int((~pos & hit).sum()),
            "collapsed_runs": int(pos.sum()), "warned": int((pos & hit).sum()),
            "precision": float((pos & hit).sum() / hit.sum()) if hit.any() else np.nan,
            "recall": float((pos & hit).sum() / pos.sum()) if pos.any() else np.nan,
            "lead_min": float(leads.min()) if len(leads) else np.nan,
            "lead_median": float(leads.median()) if len(leads) else np.nan,
            "lead_max": float(leads.max()) if len(leads) else np.nan,
            "warned_before_departure": int((leads > 0).sum())}


def choose_defaults(stab: StabilityRuns, thresholds: dict[str, float]) -> pd.DataFrame:
    """Each candidate on the calibration sweep: its false alarms, and whether it warned
    every collapsed run before its departure (docs/stability.md#alerts: the defaults)."""
    steps = int(stab.runs["steps"].max())
    rows = []
    for metric, rule in candidate_rules(thresholds, steps).items():
        one = evaluate(stab, (rule,))
        s = alert_summary(one)
        pos = one[one["collapsed"]]
        early = bool(len(pos)) and bool((pos["lead_steps"] > 0).all())
        rows.append({"metric": metric, "rule": rule.name,
                     "threshold": rule.above if rule.above is not None else rule.below,
                     "false_alarms": s["false_alarms"], "healthy_runs": s["healthy_runs"],
                     "warned": s["warned"], "collapsed_runs": s["collapsed_runs"],
                     "lead_min": s["lead_min"], "every_collapse_early": early,
                     "default": early and metric != "pr_k_token"})
    return pd.DataFrame(rows)
