"""The alert rules measured on the runs they watch (docs/stability.md#alerts): the rules
replayed (:func:`qkgeom.alerts.replay`, the monitor's own logic) on each run, their false
alarms, warnings and lead times; the thresholds of the scale-free candidates from a
calibration sweep; and which candidates become the defaults.

Every count follows one convention (docs/stability.md#amendments-before-any-run-2026-12-03):
what an alert must warn of is a collapse that hurts. A run is a *positive* when it
collapsed (entropy or divergence, :data:`~qkgeom.analysis.stability.outcomes.COLLAPSE_NATS`)
**and** its loss departed; every other run is a *negative*, whatever its entropy, and an
alert on it is a false alarm. The negatives that collapsed without departing are counted
apart ("low entropy, loss healthy"). A positive is *warned* when a rule fired at any probe,
*before departure* when the first alert came at an earlier step (lead time > 0).
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

ALERT_COLUMNS = ["run_id", "arm", "size", "lr", "seed", "collapsed", "positive",
                 "stable_none", "departure_step", "alerted", "first_alert_step", "first_rule", "lead_steps"]
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
    "C3w": ("logit_max_rate_warm", "2 × the largest layer logit_max growth rate per step "
                                   "between probes both at or after the LR warm-up"),
    "C4w": ("logit_bound_rate_warm", "2 × the largest layer logit_bound growth rate per step "
                                     "between probes both at or after the LR warm-up"),
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
    """Per run (:data:`ALERT_COLUMNS`): whether it is a positive (collapsed and departed),
    whether ``rules`` fired on its probes (every ``every``-th of them), the first alert and
    its rule, and the lead time = departure step − first alert step."""
    first = first_alerts(stab, rules, every).set_index("run_id")
    runs = stab.runs
    step = runs["run_id"].map(first["step"]).astype(float)
    out = pd.DataFrame({
        "run_id": runs["run_id"], "arm": runs["arm"], "size": runs["size"], "lr": runs["lr"],
        "seed": runs["seed"], "collapsed": runs["collapsed"].astype(bool),
        "positive": runs["collapsed"].astype(bool) & runs["departure_step"].notna(),
        "stable_none": runs["run_id"].isin(set(_stable_none(stab)["run_id"])),
        "departure_step": runs["departure_step"], "alerted": step.notna(),
        "first_alert_step": step,
        "first_rule": runs["run_id"].map(first["rule"]).astype(object).fillna(""),
        "lead_steps": runs["departure_step"] - step})
    return out[ALERT_COLUMNS].reset_index(drop=True)


def alert_summary(alerts: pd.DataFrame) -> dict[str, float]:
    """The counts of the module doc from :func:`evaluate`'s table: ``negatives`` and their
    ``false_alarms``; among them ``low_entropy_healthy`` (collapsed, loss never departed)
    and how many of those were alerted; ``positives``, ``positives_warned``,
    ``warned_before_departure`` (lead > 0); precision (positives among the alerted runs),
    recall (positives warned) and the lead times over the warned positives."""
    pos = alerts["positive"].astype(bool)
    hit = alerts["alerted"].astype(bool)
    low = alerts["collapsed"].astype(bool) & ~pos
    leads = alerts.loc[pos & hit, "lead_steps"]
    return {"negatives": int((~pos).sum()), "false_alarms": int((~pos & hit).sum()),
            "low_entropy_healthy": int(low.sum()),
            "low_entropy_healthy_alerted": int((low & hit).sum()),
            "positives": int(pos.sum()), "positives_warned": int((pos & hit).sum()),
            "warned_before_departure": int((leads > 0).sum()),
            "precision": float((pos & hit).sum() / hit.sum()) if hit.any() else np.nan,
            "recall": float((pos & hit).sum() / pos.sum()) if pos.any() else np.nan,
            "lead_min": float(leads.min()) if len(leads) else np.nan,
            "lead_median": float(leads.median()) if len(leads) else np.nan,
            "lead_max": float(leads.max()) if len(leads) else np.nan}


def warned_sentence(s: dict[str, float]) -> str:
    """What the counts say about the positives, true in every case: none; none warned;
    some warned, how many before their loss departed, with the lead times (a warned
    positive always has one: it departed)."""
    low = s["low_entropy_healthy"]
    healthy = (f"; {low} run{'s' if low != 1 else ''} of low entropy kept a healthy loss "
               f"(negatives, {s['low_entropy_healthy_alerted']} alerted)" if low else "")
    if not s["positives"]:
        return "no run both collapsed and departed (no positive)" + healthy
    head = (f"{s['positives_warned']} of {s['positives']} positives (collapsed, loss "
            "departed) warned")
    if not s["positives_warned"]:
        return head + healthy
    return (head + f", {s['warned_before_departure']} of them before their loss departed "
            f"(lead {s['lead_min']:.0f} to {s['lead_max']:.0f} steps, median "
            f"{s['lead_median']:.0f})" + healthy)


# ------------------------------------------------------------------ calibration


def log_rates(layers: pd.DataFrame, metric: str) -> pd.DataFrame:
    """``run_id, layer, prev_step, step, rate`` of one metric: (ln v_t − ln v_prev)/(t −
    t_prev) between consecutive probes of each run and layer (``prev_step`` = t_prev), both
    values finite and positive (the rate a ``rate=True`` rule reads; the first from step
    0)."""
    m = layers[layers["metric"] == metric].sort_values(["run_id", "layer", "step"])
    v = m["value"].astype(float)
    logv = np.log(v.where(np.isfinite(v) & (v > 0)))
    prev = m.groupby(["run_id", "layer"], sort=False)["step"].shift()
    rate = (logv - logv.groupby([m["run_id"], m["layer"]]).shift()) / (m["step"] - prev)
    return m[["run_id", "layer"]].assign(prev_step=prev, step=m["step"], rate=rate).dropna(
        subset=["rate"])


def calibrate(stab: StabilityRuns) -> dict[str, float]:
    """The thresholds of docs/stability.md#calibration from the stable ``none`` runs of
    every size together, unrounded: E (``attn_entropy_norm``), A (``attn_max``), the rates
    R of ``logit_max`` and ``logit_bound`` at every probe, and R′ (``*_rate_warm``) of the
    same between probes both at or after the runs' LR warm-up (NaN for a metric the runs
    lack)."""
    ids = set(_stable_none(stab)["run_id"])
    lay = stab.layers[stab.layers["run_id"].isin(ids)]
    after = lay[lay["step"] > 0]

    def pick(metric: str, how: str) -> float:
        v = after.loc[after["metric"] == metric, "value"].astype(float)
        v = v[np.isfinite(v)]
        return float(getattr(v, how)()) if len(v) else np.nan

    def rate(metric: str, from_step: int = 0) -> float:
        r = log_rates(lay, metric)
        r = r.loc[r["prev_step"] >= from_step, "rate"]
        r = r[np.isfinite(r)]
        return 2 * float(r.max()) if len(r) else np.nan

    warmup = stab.warmup
    return {"attn_entropy_norm": 0.5 * pick("attn_entropy_norm", "min"),
            "attn_max": (1 + pick("attn_max", "max")) / 2,
            "logit_max_rate": rate("logit_max"), "logit_bound_rate": rate("logit_bound"),
            "logit_max_rate_warm": rate("logit_max", warmup),
            "logit_bound_rate_warm": rate("logit_bound", warmup)}


def round2(x: float) -> float:
    """Two significant digits: a threshold is a round number a user reads and types."""
    return float(f"{x:.2g}") if np.isfinite(x) else x


def rate_after_warmup(per_step: float, warmup: int, metric: str = "logit_max") -> AlertRule:
    """C3w / C4w: ``metric`` growing faster than ``per_step`` between probes both at or
    after the LR warm-up ``warmup`` (the replay reads no probe before it, so the first
    rate is between the first two probes at or after it). Named apart from C3/C4, which
    read from step 0: one rule set refuses two rules of one name."""
    return AlertRule(f"{metric} grew faster than {per_step:g} per step after the warm-up",
                     metric, above=per_step, rate=True, from_step=int(warmup))


def candidate_rules(thresholds: dict[str, float], warmup: int) -> dict[str, AlertRule]:
    """C1–C4, C3w, C4w at the rounded thresholds, the last two reading from the LR warm-up
    ``warmup`` of the runs they watch (a candidate whose threshold is NaN is left out: the
    calibration runs lack its metric)."""
    make = {"C1": lambda t: entropy_norm_collapse(t), "C2": lambda t: attention_peak(t),
            "C3": lambda t: logit_rate(t), "C4": lambda t: logit_rate(t, "logit_bound"),
            "C3w": lambda t: rate_after_warmup(t, warmup),
            "C4w": lambda t: rate_after_warmup(t, warmup, "logit_bound")}
    return {cid: make[cid](round2(thresholds[key])) for cid, (key, _) in CANDIDATES.items()
            if np.isfinite(thresholds.get(key, np.nan))}


CHOICE_COLUMNS = ["candidate", "metric", "rule", "threshold", "from_step", "false_alarms",
                  "negatives", "low_entropy_healthy", "low_entropy_healthy_alerted",
                  "positives_warned", "positives", "warned_before_departure", "lead_min",
                  "default", "chosen_by"]


def choose_defaults(stab: StabilityRuns, thresholds: dict[str, float]) -> pd.DataFrame:
    """Each candidate on the calibration sweep (:data:`CHOICE_COLUMNS`): its false alarms
    on the negatives, its warnings of the positives, and whether it is a default
    (docs/stability.md#calibration): by the rule, it warned every positive before its
    departure and gave no false alarm on any negative; when none does, by the fallback,
    those with no false alarm that warned every positive and, of them, the most before
    their departure (``chosen_by``: ``rule``, ``fallback`` or ""); with no positive, none."""
    rows = []
    for cid, rule in candidate_rules(thresholds, stab.warmup).items():
        s = alert_summary(evaluate(stab, (rule,)))
        rows.append({"candidate": cid, "metric": rule.metric, "rule": rule.name,
                     "threshold": rule.above if rule.above is not None else rule.below,
                     "from_step": rule.from_step, **{k: s[k] for k in CHOICE_COLUMNS[5:-2]}})
    table = pd.DataFrame(rows, columns=CHOICE_COLUMNS[:-2])
    clean = (table["positives"] > 0) & (table["false_alarms"] == 0)
    by_rule = clean & (table["warned_before_departure"] == table["positives"])
    fallback = clean & (table["positives_warned"] == table["positives"])
    if not by_rule.any() and fallback.any():
        best = table.loc[fallback, "warned_before_departure"].max()
        fallback &= table["warned_before_departure"] == best
    else:
        fallback &= False
    table["default"] = by_rule | fallback
    table["chosen_by"] = np.where(by_rule, "rule", np.where(fallback, "fallback", ""))
    return table
