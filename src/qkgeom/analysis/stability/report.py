"""The stability report: per remedy and learning rate what the runs came to, the
learning-rate sweep (LR sensitivity, widest stable range, best rate), the claims and what
the seeds could resolve, the alert rules on these runs, the calibration of the candidate
thresholds, the cross-size alert table (a ``transfer`` sweep, or any sweep given a
calibration sweep), the figures.

Files: ``report.md``/``report.html``, ``claims.csv``, ``stability_runs.csv`` (one row per
run), ``stability_outcomes.csv`` (per size, remedy and learning rate),
``stability_sensitivity.csv`` (LR sensitivity per size, remedy and seed),
``stability_rates.csv`` (stable range and best rate per size and remedy),
``stability_power.csv``, ``stability_alerts.csv`` (the library's default rules replayed on
each run), ``stability_calibration.csv`` (each candidate with thresholds from these runs'
stable ``none`` runs), ``stability_transfer.csv`` (rule × model) and the figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from qkgeom.alerts import DEFAULT_RULES
from qkgeom.analysis import kit
from qkgeom.analysis.stability.alerts import (
    CANDIDATES,
    alert_summary,
    calibrate,
    choose_defaults,
    evaluate,
    round2,
    warned_sentence,
)
from qkgeom.analysis.stability.claims import DELTA_LOSS, stability_claims
from qkgeom.analysis.stability.outcomes import (
    COLLAPSE_NATS,
    DEPARTURE_NATS,
    StabilityRuns,
    read_runs,
    read_stability,
)
from qkgeom.analysis.stability.power import EFFECT_NATS, power_table
from qkgeom.analysis.stability.sensitivity import lr_sensitivity, rate_table
from qkgeom.analysis.stability.transfer import (
    CADENCES,
    Source,
    lead_text,
    requirements,
    rule_sets,
    transfer_table,
)
from qkgeom.errors import QKGeomError
from qkgeom.runs.sweep import read_sweep_record

CALIBRATION_SWEEP = "stability-calibrate"  # found beside a transfer sweep
#: Folders a transfer sweep's table also reads when they are beside it.
ALSO_BESIDE = ("stability-demo", "stability-lab", "alerts-hf")

CELLS = (("level", kit.show("level")), ("quantity", kit.show("quantity")),
         kit.ROLE_CELL, ("seeds with the sign", kit.show("measured")),
         ("predicted", kit.show("predicted")), ("mean Δ [95 % t-interval]", kit.show("estimate")),
         kit.P_CELL, ("beside", kit.show("beside")), kit.VERDICT_CELL)


def _num(x: float, digits: int = 3) -> str:
    return "n/a" if not np.isfinite(x) else f"{x:.{digits}f}"


def outcomes_table(stab: StabilityRuns) -> pd.DataFrame:
    """Per size, remedy and learning rate: runs, collapsed, diverged, and the means of the
    final numbers (diverged runs have no final val loss)."""
    g = stab.runs.groupby(["size", "arm", "lr"], sort=False)
    out = g.agg(runs=("run_id", "size"), collapsed=("collapsed", "sum"),
                diverged=("state", lambda s: int((s == "diverged").sum())),
                final_val_loss=("final_val_loss", "mean"),
                final_entropy=("final_entropy", "mean"), min_entropy=("min_entropy", "mean"),
                final_logit_max=("final_logit_max", "median"),
                acted=("acted", "all"), wall_s=("wall_s", "median")).reset_index()
    order = {a: i for i, a in enumerate(dict.fromkeys(stab.runs["arm"]))}
    sizes = {s: i for i, s in enumerate(stab.sizes)}
    return out.sort_values(["size", "lr", "arm"], key=lambda c: c.map(sizes) if c.name == "size"
                           else c if c.name == "lr" else c.map(order), kind="stable")


def outcomes_markdown(table: pd.DataFrame) -> str:
    sized = table["size"].nunique() > 1
    rows = [[*([r.size] if sized else []), f"{r.lr:g}", r.arm, f"{int(r.collapsed)}/{r.runs}",
             f"{r.diverged}", _num(r.final_val_loss), _num(r.final_entropy, 2),
             _num(r.min_entropy, 2), _num(r.final_logit_max, 1),
             "yes" if r.acted else "**no**", _num(r.wall_s, 0)] for r in table.itertuples()]
    return "\n".join([
        "## What the runs came to", "",
        f"Per {'size, ' if sized else ''}learning rate and remedy: runs that collapsed (some "
        f"layer's mean attention entropy below {COLLAPSE_NATS:g} nats at the last probe, or "
        "diverged), diverged runs, and the means over seeds of the final val loss (diverged "
        "runs have none), the final attention entropy (mean over layers) and its minimum "
        "over layers; the median final max logit (the largest scaled logit of any layer at "
        "the last probe) and wall time. *Acted*: the remedy's control acted in every seed "
        "(docs/stability.md).", "",
        kit.md_table([*(["size"] if sized else []), "lr", "remedy", "collapsed", "diverged",
                      "final val loss", "final entropy", "min entropy", "final max logit",
                      "acted", "wall (s, median)"], rows)])


def _rate(x: float) -> str:
    return "none" if not np.isfinite(x) else f"{x:g}"


def sweep_markdown(rates: pd.DataFrame, ls: pd.DataFrame) -> str:
    """The learning-rate sweep per size and remedy (descriptive)."""
    sized = rates["size"].nunique() > 1
    mean_ls = ls.groupby(["size", "arm"])["sensitivity"].agg(["mean", "count"])
    rows = []
    for r in rates.itertuples():
        span = ("none" if not np.isfinite(r.range_low) else
                f"{_rate(r.range_low)} – {_rate(r.range_high)} ({r.range_decades:.1f} decades)")
        m = mean_ls.loc[(r.size, r.arm)] if (r.size, r.arm) in mean_ls.index else None
        n = int(m["count"]) if m is not None else 0
        ls_text = f"{m['mean']:.3f} ({n} seed{'' if n == 1 else 's'})" if n else "n/a"
        rows.append([*([r.size] if sized else []), r.arm, f"{r.stable_rates}/{r.rates}", span,
                     _rate(r.best_lr), _num(r.best_median_loss), ls_text])
    return "\n".join([
        "## The learning-rate sweep", "",
        "Per remedy: the rates at which no seed collapsed or diverged, the widest run of "
        "consecutive such rates (its width in decades), the best rate (the lowest median "
        "over seeds of the final val loss clipped at L₀, a diverged run at L₀) and the LR "
        "sensitivity (Wortsman et al., 2023: the mean over the rates of the clipped loss "
        "above its best, per seed; its mean over seeds). Descriptive; S3 tests the "
        "sensitivity paired with `none`.", "",
        kit.md_table([*(["size"] if sized else []), "remedy", "stable rates",
                      "widest stable range", "best rate", "median loss at it",
                      "LR sensitivity (nats)"], rows)])


def power_markdown(power: pd.DataFrame) -> str:
    if power.empty:
        return ""
    rows = [[r.claim_id, r.arm, kit.md_text(r.level), r.n, _num(r.sd), f"{r.effect:g}",
             _num(r.power, 2), "n/a" if not np.isfinite(r.seeds_for_80) else
             f"{int(r.seeds_for_80)}"] for r in power.itertuples()]
    return "\n".join([
        "## What the seeds could resolve", "",
        f"Per primary row, the SD of its paired differences here, the power of its seeds "
        f"(S1, S3: the one-sided t-test at a gain of {EFFECT_NATS:g} nats; S2: TOST at a true "
        f"difference of 0 within ±{DELTA_LOSS:g}) and the seeds 80 % would need. With 5 seeds "
        "the sign-flip test reaches p < 0.05 only when all five agree. Descriptive: it "
        "changes no verdict (docs/stability.md#seeds-and-power).", "",
        kit.md_table(["claim", "remedy", "level", "seeds", "paired SD (nats)", "effect",
                      "power", "seeds for 80 %"], rows)])


def _kind(r: Any) -> str:
    """What a run is to the alert table: a positive, or a negative (of low entropy)."""
    if r.positive:
        return "positive"
    return "negative: low entropy, loss healthy" if r.collapsed else "negative"


def alerts_markdown(alerts: pd.DataFrame) -> str:
    s = alert_summary(alerts)
    rules = "; ".join(f"`{r.name}`" for r in DEFAULT_RULES)
    shown = alerts[alerts["collapsed"] | alerts["alerted"]].sort_values(
        ["size", "lr", "arm", "seed"])
    sized = alerts["size"].nunique() > 1
    rows = [[*([r.size] if sized else []), f"{r.lr:g}", r.arm, r.seed, _kind(r),
             _num(r.departure_step, 0), _num(r.first_alert_step, 0),
             kit.md_text(r.first_rule) or "—", _num(r.lead_steps, 0)]
            for r in shown.itertuples()]
    low = s["low_entropy_healthy"]
    return "\n".join([
        "## Alerts", "",
        f"The library's default rules ({rules}) replayed on every run, probe by probe, as "
        "the monitor fires them live. A *positive* collapsed (entropy below "
        f"{COLLAPSE_NATS:g} nats in some layer at the last probe, or diverged) **and** its "
        "loss departed: its val loss exceeded the stable `none` run of its seed (and size) "
        f"by more than {DEPARTURE_NATS:g} nats; every other run is a *negative*, whatever its "
        "entropy, and an alert on it is a false alarm (docs/stability.md#amendments-before-"
        "any-run-2026-12-03). Lead time = departure − first alert, in steps.", "",
        f"- False alarms on negatives: **{s['false_alarms']} of {s['negatives']}**"
        + (f"; {low} of the negatives had low entropy with a healthy loss, "
           f"{s['low_entropy_healthy_alerted']} of them alerted" if low else "") + ".",
        f"- Positives: {warned_sentence({**s, 'low_entropy_healthy': 0})}. Recall "
        + (f"{s['recall']:.0%}" if np.isfinite(s["recall"]) else "n/a") + "; precision "
        + (f"{s['precision']:.0%}" if np.isfinite(s["precision"]) else "n/a (nothing fired)")
        + ".", "",
        *([kit.md_table([*(["size"] if sized else []), "lr", "remedy", "seed", "run",
                         "departure step", "first alert step", "first rule", "lead (steps)"],
                        rows)] if rows else ["No run collapsed and no rule fired."])])


def calibration_markdown(thresholds: dict[str, float], candidates: pd.DataFrame,
                         chooses: bool, warmup: int) -> str:
    rows = [[r.candidate, kit.md_text(r.rule), f"{r.false_alarms}/{r.negatives}"
             + (f" ({r.low_entropy_healthy_alerted}/{r.low_entropy_healthy} low entropy)"
                if r.low_entropy_healthy else ""),
             f"{r.positives_warned}/{r.positives}",
             f"{r.warned_before_departure}/{r.positives}",
             _num(r.lead_min, 0),
             ("**yes**" + (" (fallback)" if r.chosen_by == "fallback" else "")) if r.default
             else "no"]
            for r in candidates.itertuples()]
    how = "; ".join(f"{cid} {what}: {_num(thresholds[key], 4)} → {round2(thresholds[key]):g}"
                    for cid, (key, what) in CANDIDATES.items()
                    if np.isfinite(thresholds.get(key, np.nan)))
    chosen = ", ".join(candidates.loc[candidates["default"], "candidate"]) or "none"
    why = ("by the fallback: no candidate warned every positive before its loss departed; "
           "these warned every positive, the most of them before it, with no false alarm"
           if (candidates["chosen_by"] == "fallback").any() else
           "the candidates that warned every positive before its loss departed and gave no "
           "false alarm on any negative")
    title = "## Alert calibration" if chooses else "## Alert calibration on these runs"
    note = (f"These are the protocol's thresholds (docs/stability.md#calibration), from the "
            f"stable runs of every size together. **The default rules: {chosen}** ({why}); "
            "they replace `qkgeom.alerts.DEFAULT_RULES`."
            if chooses else
            "The calibration rule of docs/stability.md applied to these runs' stable `none` "
            "runs. The thresholds are fixed on the `calibrate` preset's runs; on any other "
            "sweep this table is an out-of-sample look at the rule, not a choice.")
    return "\n".join([
        title, "", f"Thresholds (unrounded → rounded to two digits): {how or 'n/a'}. "
        f"C3w and C4w read from the end of these runs' LR warm-up, step {warmup}.", "",
        note, "",
        kit.md_table(["candidate", "rule", "false alarms (negatives)", "positives warned",
                      "warned before departure", "shortest lead",
                      "default" if chooses else "meets the default rule"], rows)
        if rows else "No candidate: the runs lack the metrics the candidates read."])


def transfer_markdown(table: pd.DataFrame, sources: Sequence[Source],
                      calibration: str) -> str:
    read = "; ".join(f"{kit.md_text(s.stab.name)} ({len(s.stab.runs)} runs"
                     + (", in-sample" if s.in_sample else "") + ")" for s in sources)
    full, sparse_ = CADENCES[0][0], CADENCES[1][0]
    keys = ["rule", "model", "source"]
    wide = table[table["cadence"] == full].merge(
        table[table["cadence"] == sparse_], on=keys, suffixes=("", "_sparse"))
    rows = []
    for r in wide.to_dict("records"):
        model = f"{kit.md_text(r['model'])} ({kit.md_text(r['source'])}"
        model += ", in-sample)" if r["in_sample"] else ")"
        rows.append([kit.md_text(r["rule"]), model,
                     f"{r['false_alarms']}/{r['negatives']}",
                     f"{r['low_entropy_healthy_alerted']}/{r['low_entropy_healthy']}",
                     f"{r['positives_warned']}/{r['positives']}",
                     f"{r['warned_before_departure']}/{r['positives']}",
                     lead_text(pd.Series(r)),
                     f"{r['false_alarms_sparse']}/{r['negatives_sparse']}",
                     f"{r['warned_before_departure_sparse']}/{r['positives_sparse']}",
                     lead_text(pd.Series({k: r[f"{k}_sparse"] for k in
                                          ("lead_median", "lead_min", "lead_max")}))])
    return "\n".join([
        "## Alerts across sizes", "",
        f"Thresholds calibrated on {kit.md_text(calibration)}; the rules replayed on: "
        f"{read}. Per rule and model: negatives (runs whose loss never departed) with a "
        "false alarm; among them the runs of low entropy and healthy loss, alerted; "
        "positives (collapsed runs whose loss departed) warned, and warned before the loss "
        "departed; lead time in steps over the warned positives (median, min to max); then "
        f"the same at every {CADENCES[1][1]}th probe "
        "(docs/stability.md#the-alert-table-and-its-requirements).",
        "", *[f"- {line}" for line in requirements(table)], "",
        kit.md_table(["rule", "model", "false alarms (negatives)",
                      "low entropy, loss healthy: alerted", "positives warned",
                      "warned before departure", "lead (steps)",
                      f"false alarms ({sparse_})", f"before departure ({sparse_})",
                      f"lead ({sparse_})"], rows)])


def stability_markdown(stab: StabilityRuns, claims: pd.DataFrame, sections: list[str],
                       figures: list[Path]) -> str:
    seeds = sorted(stab.runs["seed"].unique())
    arms = list(dict.fromkeys(stab.runs["arm"]))
    why = kit.descriptive_reason(claims)
    sizes = (f" on {len(stab.sizes)} model sizes ({', '.join(stab.sizes)}), paired within a "
             "size" if len(stab.sizes) > 1 else "")
    parts = [
        f"# qkgeom report: {kit.md_text(stab.name)}", "", kit.summary_markdown(claims), "",
        "Stability (docs/stability.md, protocol 2): learning rates "
        + ", ".join(f"{lr:g}" for lr in sorted(stab.runs["lr"].unique()))
        + f" (stable: {stab.stable_lr:g}) × remedies " + ", ".join(arms)
        + f" × {len(seeds)} seeds{sizes}, each remedy paired with the `none` run of its "
        "seed.", ""]
    for section in sections[:2]:  # what the runs came to, the learning-rate sweep
        parts += [section, ""] if section else []
    if len(claims):
        parts += ["## Claims", "", *([f"**{why}**", ""] if why else []),
                  kit.claims_markdown(claims, CELLS), "",
                  "Unit: the seed; Δ = remedy − `none` of the same seed and learning rate "
                  "(S3: of the LR sensitivities). Primary rows (S1: a rate above the stable "
                  "one, predicted Δ < 0; S2: the stable rate, no cost within "
                  f"±{DELTA_LOSS:g} nats, an equivalence claim; S3: the LR sensitivity, "
                  "predicted Δ < 0) are each their own claim at α = 0.05; the secondary rows "
                  "(the rates below the stable one, two-sided; entropy and max logit) are "
                  "Holm-adjusted together.", ""]
    for section in sections[2:]:
        parts += [section, ""] if section else []
    if len(stab.left_out):
        parts += ["## Runs left out", "", kit.md_table(
            ["run", "state", "reason"], [[f"`{kit.md_text(r.run_id)}`", r.state, r.reason]
                                         for r in stab.left_out.itertuples()]), ""]
    parts += ["## Figures", ""]
    if not figures:
        parts.append("No figure: not drawn (`figures=False`).")
    for fig in figures:
        svg = fig.with_suffix(".svg").name
        parts += [f"[![{fig.stem}]({fig.name})]({fig.name})", "",
                  f"*{fig.stem}. Vector version: [{svg}]({svg}).*", ""]
    return "\n".join(parts).rstrip() + "\n"


def _grid_name(folder: Path) -> str:
    grid = read_sweep_record(folder).get("grid")
    return str(grid.get("name", "")) if isinstance(grid, dict) else ""


def _transfer_sources(folder: Path, calibration: Path | None,
                      also: Sequence[Path]) -> tuple[Path | None, list[Path]]:
    """The calibration sweep and the other folders of the cross-size table: those named,
    else for a transfer sweep the ones beside it."""
    if calibration is None and _grid_name(folder).endswith("-transfer"):
        beside = folder.parent / CALIBRATION_SWEEP
        calibration = beside if beside.is_dir() else None
        if not also:
            also = [p for p in (folder.parent / n for n in ALSO_BESIDE) if p.is_dir()]
    if calibration is not None and not Path(calibration).is_dir():
        raise QKGeomError(f"{calibration}: no calibration sweep there (run `qkgeom reproduce "
                          "stability --preset calibrate`)")
    return calibration, [Path(p) for p in also]


def write_stability_report(folder: str | Path, out: str | Path, figures: bool = True, *,
                           calibration: str | Path | None = None,
                           also: Sequence[str | Path] = ()) -> Path:
    """The stability report of the sweep ``folder`` into ``out``; returns ``report.md``.
    ``calibration`` (a calibrate sweep) and ``also`` (sweeps or Hugging Face trial folders)
    add the cross-size alert table; a ``transfer`` sweep finds them beside it."""
    folder, out = Path(folder), Path(out)
    stab = read_stability(folder)
    kind = _grid_name(folder).rsplit("-", 1)[-1]
    cal_dir, others = _transfer_sources(folder, Path(calibration) if calibration else None,
                                        [Path(p) for p in also])
    claims, outcomes = stability_claims(stab), outcomes_table(stab)
    ls, rates = lr_sensitivity(stab), rate_table(stab)
    power = power_table(claims)
    alerts = evaluate(stab, DEFAULT_RULES)
    thresholds = calibrate(stab)
    candidates = choose_defaults(stab, thresholds)
    sections = [outcomes_markdown(outcomes),
                sweep_markdown(rates, ls) if stab.runs["lr"].nunique() > 1 else "",
                power_markdown(power), alerts_markdown(alerts),
                calibration_markdown(thresholds, candidates, kind == "calibrate",
                                     stab.warmup)]
    frames = [("claims", claims), ("stability_runs", stab.runs),
              ("stability_outcomes", outcomes), ("stability_sensitivity", ls),
              ("stability_rates", rates), ("stability_power", power),
              ("stability_alerts", alerts), ("stability_calibration", candidates)]
    if cal_dir is not None or others:
        table, text = _cross_size(stab, cal_dir, others, folder)
        sections.append(text)
        if table is not None:
            frames.append(("stability_transfer", table))
    kit.write_csvs(out, frames)
    drawn: list[Path] = []
    if figures:
        from qkgeom.analysis.stability.figures import draw, draw_lr_sweep

        if stab.runs["lr"].nunique() > 1:
            drawn.append(draw_lr_sweep(stab, out))
        drawn.append(draw(stab, out))
    text = stability_markdown(stab, claims, sections, drawn)
    return kit.write_pages(out, text, f"qkgeom report: {stab.name}")


def _cross_size(stab: StabilityRuns, cal_dir: Path | None, others: Sequence[Path],
                folder: Path) -> tuple[pd.DataFrame | None, str]:
    """The cross-size alert table and its section (a note when there is no calibration)."""
    if cal_dir is None:
        return None, ("## Alerts across sizes\n\nNo calibration sweep: run `qkgeom reproduce "
                      f"stability --preset calibrate` beside this sweep ({CALIBRATION_SWEEP}) "
                      "or pass `--calibration FOLDER`.")
    cal = read_stability(cal_dir)
    thresholds = calibrate(cal)
    defaults = choose_defaults(cal, thresholds)
    sources = [Source(cal, in_sample=True)]
    if folder.resolve() != cal_dir.resolve():
        sources.append(Source(stab))
    sources += [Source(read_runs(p)) for p in others
                if p.resolve() not in (folder.resolve(), cal_dir.resolve())]
    chosen = list(defaults.loc[defaults["default"], "candidate"])
    table = transfer_table(sources, lambda warmup: rule_sets(thresholds, chosen, warmup))
    return table, transfer_markdown(table, sources, cal.name)
