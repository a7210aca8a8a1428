"""The stability report: per remedy and learning rate what the runs came to, the claims,
the alert rules on these runs, the calibration of their thresholds, the figure.

Files: ``report.md``/``report.html``, ``claims.csv``, ``stability_runs.csv`` (one row per
run), ``stability_outcomes.csv`` (per remedy and learning rate), ``stability_alerts.csv``
(the default rules replayed on each run), ``stability_calibration.csv`` (each candidate
rule with thresholds from these runs' stable ``none`` runs) and the figure.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.alerts import DEFAULT_RULES
from qkgeom.analysis import kit
from qkgeom.analysis.stability.alerts import (
    alert_summary,
    calibrate,
    choose_defaults,
    evaluate,
)
from qkgeom.analysis.stability.claims import DELTA_LOSS, stability_claims
from qkgeom.analysis.stability.outcomes import (
    COLLAPSE_NATS,
    DEPARTURE_NATS,
    StabilityRuns,
    read_stability,
)

CELLS = (("lr", kit.show("level")), ("quantity", kit.show("quantity")),
         ("role", kit.show("role")), ("seeds with the sign", kit.show("measured")),
         ("predicted", kit.show("predicted")), ("mean Δ [95 % t-interval]", kit.show("estimate")),
         kit.P_CELL, ("beside", kit.show("beside")), kit.VERDICT_CELL)


def outcomes_table(stab: StabilityRuns) -> pd.DataFrame:
    """Per remedy and learning rate: runs, collapsed, diverged, and the means of the
    final numbers (diverged runs have no final val loss)."""
    g = stab.runs.groupby(["arm", "lr"], sort=False)
    out = g.agg(runs=("run_id", "size"), collapsed=("collapsed", "sum"),
                diverged=("state", lambda s: int((s == "diverged").sum())),
                final_val_loss=("final_val_loss", "mean"),
                final_entropy=("final_entropy", "mean"), min_entropy=("min_entropy", "mean"),
                final_logit_max=("final_logit_max", "median"),
                acted=("acted", "all")).reset_index()
    return out.sort_values(["lr", "arm"], key=lambda c: c if c.name == "lr" else c.map(
        {a: i for i, a in enumerate(dict.fromkeys(stab.runs["arm"]))}), kind="stable")


def _num(x: float, digits: int = 3) -> str:
    return "n/a" if not np.isfinite(x) else f"{x:.{digits}f}"


def outcomes_markdown(table: pd.DataFrame) -> str:
    rows = [[f"{r.lr:g}", r.arm, f"{int(r.collapsed)}/{r.runs}", f"{r.diverged}",
             _num(r.final_val_loss), _num(r.final_entropy, 2), _num(r.min_entropy, 2),
             _num(r.final_logit_max, 1), "yes" if r.acted else "**no**"]
            for r in table.itertuples()]
    return "\n".join([
        "## What the runs came to", "",
        f"Per learning rate and remedy: runs that collapsed (some layer's mean attention "
        f"entropy below {COLLAPSE_NATS:g} nats at the last probe, or diverged), diverged "
        "runs, and the means over seeds of the final val loss (diverged runs have none), the "
        "final attention entropy (mean over layers) and its minimum over layers; the median "
        "final max logit (the largest scaled logit of any layer at the last probe). "
        "*Acted*: the remedy's control acted in every seed (docs/stability.md).", "",
        kit.md_table(["lr", "remedy", "collapsed", "diverged", "final val loss",
                      "final entropy", "min entropy", "final max logit", "acted"], rows)])


def alerts_markdown(alerts: pd.DataFrame) -> str:
    s = alert_summary(alerts)
    rules = "; ".join(f"`{r.name}`" for r in DEFAULT_RULES)
    pos = alerts[alerts["collapsed"]].sort_values(["lr", "arm", "seed"])
    rows = [[f"{r.lr:g}", r.arm, r.seed, _num(r.departure_step, 0),
             _num(r.first_alert_step, 0), kit.md_text(r.first_rule) or "—",
             _num(r.lead_steps, 0)] for r in pos.itertuples()]
    lead = ("no collapsed run was warned" if not np.isfinite(s["lead_min"]) else
            f"lead time {_num(s['lead_min'], 0)}–{_num(s['lead_max'], 0)} steps (median "
            f"{_num(s['lead_median'], 0)}); {s['warned_before_departure']} of {s['warned']} "
            "warned before their loss departed")
    return "\n".join([
        "## Alerts", "",
        f"The monitor's default rules ({rules}) replayed on every run, probe by probe, as "
        "the monitor fires them live. Departure: the first validation step at which a run's "
        f"val loss exceeds the stable `none` run of its seed by more than {DEPARTURE_NATS:g} "
        "nats; lead time = departure − first alert, in steps.", "",
        f"- False alarms on the stable `none` runs: **{s['stable_false_alarms']} of "
        f"{s['stable_runs']}**; on every run that did not collapse: {s['false_alarms']} of "
        f"{s['healthy_runs']}.",
        f"- Collapsed runs warned (recall): **{s['warned']} of {s['collapsed_runs']}**"
        + (f" ({s['recall']:.0%})" if np.isfinite(s["recall"]) else "")
        + "; precision: " + (f"{s['precision']:.0%}" if np.isfinite(s["precision"])
                             else "n/a (nothing fired)") + f"; {lead}.", "",
        *([kit.md_table(["lr", "remedy", "seed", "departure step", "first alert step",
                         "first rule", "lead (steps)"], rows)] if rows else
          ["No run collapsed."])])


def calibration_markdown(thresholds: dict[str, float], candidates: pd.DataFrame) -> str:
    rows = [[f"`{r.metric}`", kit.md_text(r.rule), f"{r.false_alarms}/{r.healthy_runs}",
             f"{r.warned}/{r.collapsed_runs}", _num(r.lead_min, 0),
             "yes" if r.every_collapse_early else "no"] for r in candidates.itertuples()]
    return "\n".join([
        "## Alert calibration on these runs", "",
        "The calibration rule of docs/stability.md applied to these runs' stable `none` "
        "runs: 2 × their largest layer `logit_max` "
        f"({_num(thresholds['logit_max'], 2)}), 2 × their largest layer `logit_delta` "
        f"({_num(thresholds['logit_delta'], 2)}), ½ × their smallest layer attention "
        f"entropy after step 0 ({_num(thresholds['attn_entropy'], 3)} nats), rounded to "
        "two digits; the key-PR rule from the first probe at or after 25 % of the run. "
        "The defaults were fixed on the `calibrate` preset's runs; on any other sweep this "
        "table is an out-of-sample look at the rule, not a choice.", "",
        kit.md_table(["metric", "rule", "false alarms (healthy runs)",
                      "collapsed runs warned", "shortest lead",
                      "every collapse warned before departure"], rows)])


def stability_markdown(stab: StabilityRuns, claims: pd.DataFrame, outcomes: pd.DataFrame,
                       alerts: pd.DataFrame, thresholds: dict[str, float],
                       candidates: pd.DataFrame, figure: Path | None) -> str:
    seeds = sorted(stab.runs["seed"].unique())
    arms = list(dict.fromkeys(stab.runs["arm"]))
    why = kit.descriptive_reason(claims)
    parts = [
        f"# qkgeom report: {kit.md_text(stab.name)}", "", kit.summary_markdown(claims), "",
        "Stability (docs/stability.md): learning rates "
        + ", ".join(f"{lr:g}" for lr in sorted(stab.runs["lr"].unique()))
        + f" (stable: {stab.stable_lr:g}) × remedies " + ", ".join(arms)
        + f" × {len(seeds)} seeds, each remedy paired with the `none` run of its seed.", "",
        outcomes_markdown(outcomes), "", "## Claims", "",
        *([f"**{why}**", ""] if why else []),
        kit.claims_markdown(claims, CELLS), "",
        "Unit: the seed; Δ = remedy − `none` of the same seed and learning rate. Primary "
        "rows (S1: a high learning rate, predicted Δ < 0; S2: the stable one, equivalence "
        f"within ±{DELTA_LOSS:g} nats) are each their own claim at α = 0.05; the secondary "
        "rows are Holm-adjusted together. p: the exact one-sided sign-flip test.", "",
        alerts_markdown(alerts), "", calibration_markdown(thresholds, candidates), ""]
    if len(stab.left_out):
        parts += ["## Runs left out", "", kit.md_table(
            ["run", "state", "reason"], [[f"`{kit.md_text(r.run_id)}`", r.state, r.reason]
                                         for r in stab.left_out.itertuples()]), ""]
    parts += ["## Figure", ""]
    if figure is None:
        parts.append("No figure: not drawn (`figures=False`).")
    else:
        parts += [f"[![stability]({figure.name})]({figure.name})", "",
                  f"*Per remedy, the layer-minimum attention entropy and the largest layer "
                  f"max logit against step, one colour per learning rate. Vector version: "
                  f"[{figure.with_suffix('.svg').name}]({figure.with_suffix('.svg').name}).*"]
    return "\n".join(parts).rstrip() + "\n"


def write_stability_report(folder: Path, out: Path, figures: bool = True) -> Path:
    """The stability report of the sweep ``folder`` into ``out``; returns ``report.md``."""
    stab = read_stability(folder)
    thresholds = calibrate(stab)
    claims, outcomes, alerts = stability_claims(stab), outcomes_table(stab), evaluate(stab)
    candidates = choose_defaults(stab, thresholds)
    kit.write_csvs(out, (("claims", claims), ("stability_runs", stab.runs),
                         ("stability_outcomes", outcomes), ("stability_alerts", alerts),
                         ("stability_calibration", candidates)))
    figure = None
    if figures:
        from qkgeom.analysis.stability.figures import draw

        figure = draw(stab, out)
    text = stability_markdown(stab, claims, outcomes, alerts, thresholds, candidates, figure)
    return kit.write_pages(out, text, f"qkgeom report: {stab.name}")
