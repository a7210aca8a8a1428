"""The alert rules measured on the runs they watch (docs/stability.md#alerts): the rules
replayed (:func:`qkgeom.alerts.replay`, the monitor's own logic) on each run, their false
alarms, warnings and lead times; the thresholds of the scale-free candidates from a
calibration sweep; and which candidates become the defaults.

Every count follows one convention: a run is *stable* when it did not collapse; a
collapsed run is *warned* when a rule fired at any probe; it is warned *before departure*
when it departs and the first alert came at an earlier step. A collapsed run whose loss
never departs has no lead time and is counted apart.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.alerts import (
    AlertRule,
    attention_peak,
    entropy_collapse,
    entropy_norm_collapse,
    logit_growth,
    logit_jump,
    logit_rate,
    replay,
)
from qkgeom.analysis.stability.outcomes import NONE, StabilityRuns

ALERT_COLUMNS = ["run_id", "arm", "size", "lr", "seed", "collapsed", "stable_none",
                 "departure_step", "alerted", "first_alert_step", "first_rule", "lead_steps"]
SPARSE_EVERY = 4  # the sparser cadence: every 4th probe of a run's record
#: Protocol 1's defaults, fixed on the demo model alone: a comparator.
PROTOCOL1_RULES = (logit_growth(74.0), logit_jump(8.8), entropy_collapse(0.59))
#: Megatron-style: the largest logit above 100 (the scale at which QK-Clip acts).
MEGATRON_RULES = (logit_growth(100.0),)
#: Candidate id -> (the threshold it reads, what that threshold is).
CANDIDATES = {
    "C1": ("attn_entropy_norm", "½ × the smallest layer attn_entropy_norm after step 0"),
    "C2": ("attn_max", "(1 + the largest layer attn_max after step 0) / 2"),
    "C3": ("logit_max_rate", "2 × the largest layer logit_max growth rate per step"),
    "C4": ("logit_bound_rate", "2 × the largest layer logit_bound growth rate per step"),
}


# ------------------------------------------------------------------ replaying rules


LAYER_STRIDE = 1_000_000  # run i's layer l replays as layer i·stride + l (keys never meet)


def run_metrics(stab: StabilityRuns, run_id: str | None = None) -> pd.DataFrame:
    """``run_id, step, layer, head, metric, value`` of the layer rows (of one run)."""
    rows = stab.layers if run_id is None else stab.layers[stab.layers["run_id"] == run_id]
    return rows.assign(head=-1)[["run_id", "step", "layer", "head", "metric", "value"]]


def sparse(metrics: pd.DataFrame, every: int = SPARSE_EVERY) -> pd.DataFrame:
    """The rows of each run's probes 0, ``every``, 2·``every``, … (in step order; one run
    when ``metrics`` has no ``run_id``)."""
    if every <= 1:
        return metrics
    by = metrics["run_id"] if "run_id" in metrics else pd.Series(0, index=metrics.index)
    rank = metrics["step"].groupby(by).rank(method="dense") - 1
    return metrics[rank % every == 0]


def _stable_none(stab: StabilityRuns) -> pd.DataFrame:
    runs = stab.runs
    return runs[(runs["arm"] == NONE) & np.isclose(runs["lr"], stab.stable_lr)]


def first_alerts(stab: StabilityRuns, rules: tuple[AlertRule, ...], every: int = 1
                 ) -> pd.DataFrame:
    """``run_id, step, rule``: the first alert of each run that ``rules`` warn, replayed
    on its probes (every ``every``-th). One replay for all runs: a rule keeps its state per
    (layer, head), so each run's layers are given keys of their own."""
    metrics = {r.metric for r in rules}
    m = stab.layers[stab.layers["metric"].isin(metrics)]
    m = sparse(m, every)
    code = {rid: i for i, rid in enumerate(stab.runs["run_id"])}
    index = m["run_id"].map(code)
    m = m[index.notna()]
    index = index[index.notna()].astype(np.int64)
    frame = pd.DataFrame({"step": m["step"].to_numpy(),
                          "layer": index.to_numpy() * LAYER_STRIDE + m["layer"].to_numpy(),
                          "head": -1, "metric": m["metric"].to_numpy(),
                          "value": m["value"].to_numpy()})
    fired = replay(frame, rules)
    ids = list(code)
    rows = pd.DataFrame({"run_id": [ids[a.layer // LAYER_STRIDE] for a in fired],
                         "step": [a.step for a in fired],
                         "layer": [a.layer % LAYER_STRIDE for a in fired],
                         "rule": [a.rule for a in fired]})
    rows = rows.sort_values(["run_id", "step", "layer"], kind="stable")
    return rows.drop_duplicates("run_id")[["run_id", "step", "rule"]]


def evaluate(stab: StabilityRuns, rules: tuple[AlertRule, ...], every: int = 1
             ) -> pd.DataFrame:
    """Per run (:data:`ALERT_COLUMNS`): whether ``rules`` fired on its probes (every
    ``every``-th of them), the first alert and its rule, and the lead time = departure
    step − first alert step."""
    first = first_alerts(stab, rules, every).set_index("run_id")
    runs = stab.runs
    step = runs["run_id"].map(first["step"]).astype(float)
    out = pd.DataFrame({
        "run_id": runs["run_id"], "arm": runs["arm"], "size": runs["size"], "lr": runs["lr"],
        "seed": runs["seed"], "collapsed": runs["collapsed"].astype(bool),
        "stable_none": runs["run_id"].isin(set(_stable_none(stab)["run_id"])),
        "departure_step": runs["departure_step"], "alerted": step.notna(),
        "first_alert_step": step,
        "first_rule": runs["run_id"].map(first["rule"]).astype(object).fillna(""),
        "lead_steps": runs["departure_step"] - step})
    return out[ALERT_COLUMNS].reset_index(drop=True)


def alert_summary(alerts: pd.DataFrame) -> dict[str, float]:
    """The counts of the module doc: false alarms (on the stable ``none`` runs, and on every
    run that did not collapse), warned collapsed runs, those that depart and those warned
    before it, precision, recall and the lead times."""
    pos, hit = alerts["collapsed"].astype(bool), alerts["alerted"].astype(bool)
    departs = pos & alerts["departure_step"].notna()
    timed = departs & hit
    leads = alerts.loc[timed, "lead_steps"]
    stable = alerts["stable_none"].astype(bool)
    return {"stable_runs": int(stable.sum()), "stable_false_alarms": int((stable & hit).sum()),
            "healthy_runs": int((~pos).sum()), "false_alarms": int((~pos & hit).sum()),
            "collapsed_runs": int(pos.sum()), "warned": int((pos & hit).sum()),
            "departing": int(departs.sum()), "never_departing": int((pos & ~departs).sum()),
            "warned_before_departure": int((leads > 0).sum()),
            "precision": float((pos & hit).sum() / hit.sum()) if hit.any() else np.nan,
            "recall": float((pos & hit).sum() / pos.sum()) if pos.any() else np.nan,
            "lead_min": float(leads.min()) if len(leads) else np.nan,
            "lead_median": float(leads.median()) if len(leads) else np.nan,
            "lead_max": float(leads.max()) if len(leads) else np.nan}


def warned_sentence(s: dict[str, float]) -> str:
    """What the counts say about warning before departure, true in every case (no
    collapse; collapses that never depart; none warned; some warned, with lead times)."""
    if not s["collapsed_runs"]:
        return "no run collapsed"
    head = f"{s['warned']} of {s['collapsed_runs']} collapsed runs warned"
    never = (f"; {s['never_departing']} of them never departed (no lead time)"
             if s["never_departing"] else "")
    if not s["departing"]:
        return head + "; no collapsed run's loss departed, so no lead time can be measured"
    timed = f"{s['departing']} that departed"
    if not np.isfinite(s["lead_min"]):
        return head + never + f"; none of the {timed} was warned"
    return (head + never + f"; of the {timed}, {s['warned_before_departure']} warned before "
            f"their loss departed (lead {s['lead_min']:.0f} to {s['lead_max']:.0f} steps, "
            f"median {s['lead_median']:.0f})")


# ------------------------------------------------------------------ calibration


def log_rates(layers: pd.DataFrame, metric: str) -> pd.DataFrame:
    """``run_id, layer, step, rate`` of one metric: (ln v_t − ln v_prev)/(t − t_prev)
    between consecutive probes of each run and layer, both values finite and positive
    (the rate a ``rate=True`` rule reads; the first from step 0)."""
    m = layers[layers["metric"] == metric].sort_values(["run_id", "layer", "step"])
    v = m["value"].astype(float)
    logv = np.log(v.where(np.isfinite(v) & (v > 0)))
    g = m.groupby(["run_id", "layer"], sort=False)
    rate = (logv - logv.groupby([m["run_id"], m["layer"]]).shift()) / (
        m["step"] - g["step"].shift())
    return m[["run_id", "layer", "step"]].assign(rate=rate).dropna(subset=["rate"])


def calibrate(stab: StabilityRuns) -> dict[str, float]:
    """The thresholds of docs/stability.md#calibration from the stable ``none`` runs of
    every size together, unrounded: E (``attn_entropy_norm``), A (``attn_max``) and the
    rates R of ``logit_max`` and ``logit_bound`` (NaN for a metric the runs lack)."""
    ids = set(_stable_none(stab)["run_id"])
    lay = stab.layers[stab.layers["run_id"].isin(ids)]
    after = lay[lay["step"] > 0]

    def pick(metric: str, how: str) -> float:
        v = after.loc[after["metric"] == metric, "value"].astype(float)
        v = v[np.isfinite(v)]
        return float(getattr(v, how)()) if len(v) else np.nan

    def rate(metric: str) -> float:
        r = log_rates(lay, metric)["rate"]
        r = r[np.isfinite(r)]
        return 2 * float(r.max()) if len(r) else np.nan

    return {"attn_entropy_norm": 0.5 * pick("attn_entropy_norm", "min"),
            "attn_max": (1 + pick("attn_max", "max")) / 2,
            "logit_max_rate": rate("logit_max"), "logit_bound_rate": rate("logit_bound")}


def round2(x: float) -> float:
    """Two significant digits: a threshold is a round number a user reads and types."""
    return float(f"{x:.2g}") if np.isfinite(x) else x


def candidate_rules(thresholds: dict[str, float]) -> dict[str, AlertRule]:
    """C1–C4 at the rounded thresholds (a candidate whose threshold is NaN is left out:
    the calibration runs lack its metric)."""
    make = {"C1": lambda t: entropy_norm_collapse(t), "C2": lambda t: attention_peak(t),
            "C3": lambda t: logit_rate(t), "C4": lambda t: logit_rate(t, "logit_bound")}
    return {cid: make[cid](round2(thresholds[key])) for cid, (key, _) in CANDIDATES.items()
            if np.isfinite(thresholds.get(key, np.nan))}


def choose_defaults(stab: StabilityRuns, thresholds: dict[str, float]) -> pd.DataFrame:
    """Each candidate on the calibration sweep: its false alarms, warnings, and whether it
    is a default: it warned every collapsed run, and every one that departs before its
    departure (docs/stability.md#calibration)."""
    rows = []
    for cid, rule in candidate_rules(thresholds).items():
        s = alert_summary(evaluate(stab, (rule,)))
        default = (s["collapsed_runs"] > 0 and s["warned"] == s["collapsed_runs"]
                   and s["warned_before_departure"] == s["departing"])
        rows.append({"candidate": cid, "metric": rule.metric, "rule": rule.name,
                     "threshold": rule.above if rule.above is not None else rule.below,
                     "false_alarms": s["false_alarms"], "healthy_runs": s["healthy_runs"],
                     "warned": s["warned"], "collapsed_runs": s["collapsed_runs"],
                     "warned_before_departure": s["warned_before_departure"],
                     "departing": s["departing"], "lead_min": s["lead_min"],
                     "default": bool(default)})
    return pd.DataFrame(rows, columns=["candidate", "metric", "rule", "threshold",
                                       "false_alarms", "healthy_runs", "warned",
                                       "collapsed_runs", "warned_before_departure",
                                       "departing", "lead_min", "default"])
