"""The E1/E2 report of a sweep or of one run folder: the summary line and the claims table
first, then the per-layer rows, the reference sensitivity, setup, excluded runs, figures;
a width ladder (:mod:`.ladder`) opens with its verdicts by width and the trend test
instead. Files: docs/report.md. A folder that records only some metrics (a monitored run)
gets the claims it can measure; the others read *not evaluated* and the figures it cannot
draw are listed as skipped.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.collate import Collated
from qkgeom.analysis.e1 import ladder as lad
from qkgeom.analysis.e1.claims import (
    CLAIMS,
    READINGS,
    contrast_readings,
    evaluate_claims,
    layer_mean_rows,
    per_layer_rows,
    sensitivity_summary,
)
from qkgeom.analysis.e1.trajectories import (
    LEVELS,
    cell_stats,
    layer_statistics,
    level_metrics,
    reference_sensitivity,
    run_stats,
)
from qkgeom.analysis.health import health_markdown, run_health
from qkgeom.analysis.kit import (
    Drawn,
    claims_markdown,
    descriptive_reason,
    distinct,
    excluded_markdown,
    figure_markdown,
    fmt_p,
    md_table,
    md_text,
    metrics_note,
    missing_metrics,
    not_recorded_reason,
    run_groups,
    setup_markdown,
    signed,
    summary_markdown,
    with_ci,
    write_csvs,
    write_pages,
)
from qkgeom.runs import is_run_folder

FIGURE_TITLES = {
    "pr": "(a) PR_Q and PR_K", "contrast": "(b) Paired contrast PR_Q − PR_K",
    "qk_entropy": "(c) Interaction PR and attention entropy",
    "heads": "(d) Heads: interaction PR vs attention entropy",
}
#: Captions; ``{spread}`` is how the seeds are shown (figstyle.spread_note).
CAPTIONS = {
    "pr": "PR_Q (solid) and PR_K (dashed) of each layer against training step, one colour "
          "per layer, log scale; {spread}; dotted line: reference step.",
    "contrast": "Paired contrast PR_Q − PR_K of each layer against training step; above the "
                "grey 0 line the queries are higher-dimensional than the keys (E1.3); "
                "{spread}; dotted line: reference step.",
    "qk_entropy": "PR of the interaction spectrum W_Q W_Kᵀ (upper row of each depth, log "
                  "scale) and mean attention entropy (lower row) against step, one colour "
                  "per layer (entropy: mean over heads); {spread}.",
    "heads": "Every head of every run at the run's last probe (where E2.3 is measured): "
             "interaction PR against attention entropy, one colour per layer (E2.3's ρ is "
             "taken across the heads of one layer).",
}
#: The figures of protocol 2, drawn once per report: name -> (title, caption).
EXTRA_FIGURES = {
    "ladder_effects": (
        "Width ladder: each primary effect against width",
        "Each claim's primary statistic per seed (thin lines join a seed's runs across the "
        "widths) and the mean over seeds with its 95 % t-interval (black), token level from "
        "the reference (E2.3 at the last probe); open markers: the arms at their width "
        "(shifted right); each title: the trend test (slope on log₂ width over seeds, "
        "two-sided sign-flip, Holm over the six)."),
    "per_layer": (
        "Per layer: every claim's primary statistic (secondary)",
        "Each run's value of the claim's primary statistic per layer index (token level, "
        "from the reference; E2.3 at the last probe), coloured by depth (a ladder: by "
        "setting); black: the mean "
        "over the runs that have the layer, with its 95 % t-interval; right: the run-level "
        "value (the mean over the run's layers), the unit of the primary row."),
    "reference_sensitivity": (
        "Reference sensitivity: E1.1 and E1.2 against the reference step (secondary)",
        "ΔPR_Q (E1.1) and ΔPR_K (E1.2) from the reference to the last probe, mean over runs "
        "with its 95 % t-band, with the reference at every probe from 5 % to 75 % of the "
        "run; thin lines: each run (one setting only); dotted: the protocol's reference, "
        "whose rows decide the claims. Descriptive: nothing is decided here."),
}


#: The metric stems (:func:`~qkgeom.analysis.e1.trajectories.level_metrics`) each claim
#: needs: a row none of whose runs recorded one of them says which, and the setting that does.
CLAIM_METRICS = {"E1.1": ("pr_q",), "E1.2": ("pr_k",), "E1.3": ("contrast",),
                 "E2.1": ("pr_k", "pr_qk"), "E2.2": ("pr_qk", "attn_entropy"),
                 "E2.3": ("pr_qk", "attn_entropy")}


def name_missing_metrics(claims: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """``claims`` with the reason of every row that measured no run because the metrics
    it needs are not recorded (a monitored run records only its ``metrics=``): which
    metrics, and the setting that records them."""
    if claims.empty or table.empty:
        return claims
    claims = claims.copy()
    heads = table[table["head"] >= 0]
    for i, r in claims.iterrows():
        if int(r["n"]) or (isinstance(r["reason"], str) and r["reason"]):
            continue
        rows = heads if r["claim_id"] == "E2.3" else table  # E2.3 is measured per head
        names = level_metrics(str(r["level"]))
        needed = [names[m] for m in CLAIM_METRICS.get(r["claim_id"], ())]
        missing = missing_metrics(rows, needed)
        if missing:
            claims.at[i, "reason"] = not_recorded_reason(missing)
    return claims


def e1_claims(data: Collated) -> dict[str, pd.DataFrame]:
    """Everything the E1/E2 report shows of a collated table: ``claims`` (a row that
    could not be measured for want of recorded metrics names them in ``reason``; per-layer
    rows have a ``layer``), ``readings`` (E1.3 four ways), ``runs`` (one row per run, level
    and origin), ``cells``, ``trajectories`` (seed-averaged layers), ``run_layers`` (per run
    and layer), ``sensitivity`` and ``sensitivity_runs`` (the reference moved from 5 % to
    75 % of the run) and ``settings`` (:func:`.ladder.ladder_settings`, empty unless the
    sweep is a width ladder). A ladder's ``claims`` are each setting's (``setting``,
    ``width``) and it adds ``trend``, ``seed_effects`` and ``arms`` (:mod:`.ladder`)."""
    if data.metrics.empty:
        per_layer = traj = pd.DataFrame()
        sens_runs = reference_sensitivity(data, levels=())
    else:
        per_layer, traj = layer_statistics(data)
        sens_runs = reference_sensitivity(data)
    runs = run_stats(per_layer)
    settings = lad.ladder_settings(data)
    out = {"readings": contrast_readings(per_layer, traj), "runs": runs,
           "cells": cell_stats(runs), "trajectories": traj, "run_layers": per_layer,
           "sensitivity": sensitivity_summary(sens_runs), "sensitivity_runs": sens_runs,
           "settings": settings}
    if settings.empty:
        out["claims"] = name_missing_metrics(evaluate_claims(per_layer, traj), data.metrics)
        return out
    claims = lad.setting_claims(per_layer, traj, settings)
    effects = lad.seed_effects(runs, settings)
    out["readings"] = lad.per_setting(per_layer, traj, settings, contrast_readings)
    return {**out, "claims": name_missing_metrics(claims, data.metrics), "seed_effects": effects,
            "trend": lad.trend_rows(effects), "arms": lad.arm_comparison(effects, settings)}


def _rules_text() -> str:
    return (
        "**Unit: the run** (every run of the grid has its own seed, so runs are independent; "
        "layers of one run are not). A run's value is the mean over its layers of the layer "
        "statistic. Each claim has one **primary** row, declared in `docs/protocols.md` "
        "before any run (token level, from the reference; E2.3 at the last checkpoint): the "
        "primary rows are Holm-adjusted together and decide the claims; the other rows are "
        "**secondary** (Holm-adjusted among themselves, descriptive). Verdicts "
        f"(`qkgeom.analysis.stats.verdict`): **supported** = the predicted direction "
        f"significant (exact one-sided sign-flip p < {stats.ALPHA} over runs, adjusted) in "
        f"≥ {stats.SUPPORT_SHARE:.0%} of runs (for E1.3, a claim about *all* trajectories, "
        "also every seed-averaged layer trajectory positive); **mixed** = significant but "
        "in fewer runs, or not in every trajectory; **not supported** = the opposite "
        "direction significant; **inconclusive** = neither; **not evaluated** = no run "
        "could be measured. A zero counts against the claim. The estimate is the mean over "
        "runs with its 95 % t-interval. *Beside*: the same test over depth × init cells "
        "(seed means) and the count of seed-averaged layer trajectories (the paper's unit; "
        "descriptive, no p: its layers are not independent). Each row says its origin: "
        "*step 0*, or the post-transient *reference* (first probe at or after 25 % of the "
        "run, or the configured `reference_step`). E2.1 and E2.2 correlate the probe-to-probe "
        "*changes* (two series that both trend with training correlate in their levels "
        "whatever links them), and their primary rows (protocol 2) subtract the mean "
        "cross-run ρ of the same depth and setting (run i's changes with run j's): a "
        "profile every run shares passes the within-run ρ (the secondary row \"no null\"), "
        "not this one. Per-layer rows (secondary) show each claim per layer index. "
        "Protocol: `docs/protocols.md` (protocol 2)."
    )


def _caveats(per_layer: pd.DataFrame) -> list[str]:
    out = []
    if not len(per_layer):
        return out
    if (per_layer["n_heads"] < 3).any():
        out.append("- Layers with fewer than 3 heads make the across-head Spearman ρ (E2.3) "
                   "±1 by construction; read E2.3 as a sign only.")
    if ((per_layer["origin"] == "reference") & (per_layer["n_steps"] < 3)).any():
        out.append("- From the reference step some trajectories have fewer than 3 probes; "
                   "their correlations are n/a.")
    return out


def readings_markdown(readings: pd.DataFrame, descriptive: bool = False) -> str:
    """E1.3 read four ways, side by side (the primary reading in bold); ``descriptive``
    (too few runs for a verdict): without the verdict column."""
    if readings.empty:
        return ""
    rows = []
    by_setting = "setting" in readings
    order = ["setting"] if by_setting else []
    for r in readings.sort_values([*order, "level", "origin", "reading"],
                                  ascending=[*([True] if by_setting else []), False, True,
                                             True]).itertuples():
        label = f"**({r.reading})**" if r.primary else f"({r.reading})"
        rows.append([*([md_text(r.setting)] if by_setting else []), label, r.criterion,
                     r.level, r.origin, f"{r.k}/{r.n}",
                     with_ci(r.mean, r.ci_low, r.ci_high), fmt_p(r.p_value),
                     f"{r.cells_k}/{r.cells_n}",
                     f"{r.traj_k}/{r.traj_n}", *([] if descriptive else [f"**{r.verdict}**"])])
    return "\n".join([
        "## E1.3 read four ways", "",
        "\"PR_Q − PR_K > 0 in all trajectories\" can mean any of these; each is counted over "
        "runs (a run's value: the mean over its layers), over cells and over seed-averaged "
        f"layer trajectories. The primary reading is **({READINGS[2][0]})**, fixed in "
        "`docs/protocols.md`: the claim is about whole trajectories after the transient, and "
        "a time average is not decided by one noisy probe. File: `contrast_readings.csv`.",
        "", md_table([*(["setting"] if by_setting else []), "reading",
                      "criterion (per layer)", "level", "origin", "runs",
                      "mean over runs [95 % t]", "p (sign-flip)", "cells",
                      "layer trajectories",
                      *([] if descriptive else ["verdict as a universal claim"])], rows)])


def _figure_name(key: str) -> str:
    if key in EXTRA_FIGURES:
        return EXTRA_FIGURES[key][0]
    kind, level = key.rsplit("_", 1)
    return f"{FIGURE_TITLES[kind]} — {level} level"


def _caption(key: str, figs: Drawn) -> str:
    if key in EXTRA_FIGURES:
        return EXTRA_FIGURES[key][1]
    kind, level = key.rsplit("_", 1)
    return f"{CAPTIONS[kind].format(spread=figs.spread)} {level.capitalize()} level."


def _figures_markdown(figs: Drawn) -> list[str]:
    """The figures section: each drawn figure with its caption, then the figures skipped
    for want of metrics or because they would show nothing."""
    parts = ["## Figures", ""]
    empty = figs.empty
    if not (figs.pngs or figs.missing or empty):
        parts.append("No figures: no run could be analysed." if figs.asked else
                     "No figures: not drawn (`figures=False`).")
    for key, png in figs.pngs.items():
        parts += [*figure_markdown(png, _caption(key, figs), _figure_name(key)), ""]
    if figs.missing:
        parts += ["Skipped (their metrics are not recorded here): " + "; ".join(
            f"{_figure_name(key)} (no {', '.join(f'`{m}`' for m in missing)})"
            for key, missing in figs.missing.items()) + ".", ""]
    if empty:
        parts += ["Not drawn (they would show nothing): " + "; ".join(
            f"{_figure_name(key)} ({why})" for key, why in empty.items()) + ".", ""]
    return parts


def _settings_col(frame: pd.DataFrame) -> bool:
    return "setting" in frame and frame["setting"].nunique() > 0


def per_layer_markdown(claims: pd.DataFrame, descriptive: bool = False) -> str:
    """The per-layer rows (secondary): each claim's primary statistic per layer index, the
    runs that have the layer as units; ``descriptive``: without the verdict column."""
    rows_of = per_layer_rows(claims)
    if rows_of.empty:
        return ""
    by_setting = _settings_col(rows_of)
    rows = []
    for r in rows_of.itertuples():
        rows.append([*([md_text(r.setting)] if by_setting else []), r.claim_id,
                     int(r.layer), r.measured, r.estimate, fmt_p(r.p_adj),
                     *([] if descriptive else [f"**{r.verdict}**"])])
    return "\n".join([
        "## Per layer (secondary)", "",
        "Each claim's primary statistic per layer index (token level, from the reference; "
        "E2.3 at the last checkpoint), its units the runs that have that layer. Secondary: "
        "Holm-adjusted with the other secondary rows, never deciding a claim; the primary row "
        "stays the mean over a run's layers (fixed before protocol 1's runs). They show when "
        "a run-level verdict is one layer against the rest. In `claims.csv` (column "
        "`layer`); figure: *per layer* below.", "",
        md_table([*(["setting"] if by_setting else []), "claim", "layer", "runs with the sign",
                  "estimate [95 % t-interval]", "p (Holm)",
                  *([] if descriptive else ["verdict"])], rows)])


def sensitivity_markdown(summary: pd.DataFrame, settings: pd.DataFrame) -> str:
    """The reference-sensitivity table at the token level (both levels in the CSV)."""
    token = summary[summary["level"] == "token"] if len(summary) else summary
    if token.empty:
        return ""
    labels = dict(zip(settings["variant"], settings["setting"], strict=False)) \
        if len(settings) else {}
    by_setting = len(labels) > 0
    rows = []
    for (variant, step), g in token.groupby(["variant", "reference_step"], sort=True):
        g = g.set_index("claim_id")
        cells = []
        for cid in ("E1.1", "E1.2"):
            r = g.loc[cid]
            cells += [f"{r['k']}/{r['n']}", with_ci(r["mean"], r["ci_low"], r["ci_high"]),
                      fmt_p(r["p_value"])]
        share = float(g["share"].iloc[0])
        ref = f"**{step}** (primary)" if bool(g["primary"].any()) else str(step)
        rows.append([*([md_text(labels.get(variant, variant))] if by_setting else []), ref,
                     f"{share:.0%}", *cells])
    return "\n".join([
        "## Reference sensitivity (secondary)", "",
        "E1.1 and E1.2 at the token level with the reference moved to every probe from 5 % "
        "to 75 % of the run: runs with the predicted sign (ΔPR_Q > 0, ΔPR_K < 0), the mean "
        "over runs with its 95 % t-interval and the one-sided sign-flip p, **unadjusted and "
        "descriptive**: the primary reference (bold) is fixed in `docs/protocols.md` and "
        "alone decides the claims. Both levels: `reference_sensitivity.csv` (per run: "
        "`reference_sensitivity_runs.csv`); figure: *reference sensitivity* below.", "",
        md_table([*(["setting"] if by_setting else []), "reference step", "of the run",
                  "E1.1 runs", "E1.1 ΔPR_Q [95 % t]", "E1.1 p", "E1.2 runs",
                  "E1.2 ΔPR_K [95 % t]", "E1.2 p"], rows)])


def ladder_markdown(e1: dict[str, pd.DataFrame], descriptive: bool = False) -> str:
    """The ladder's opening sections: the verdicts by width (each setting's primary rows)
    beside the trend test, the trend rows, the arms against their rung; ``descriptive``
    (too few runs for a verdict): what was measured, without the verdicts."""
    claims, trend, settings, arms = e1["claims"], e1["trend"], e1["settings"], e1["arms"]
    prim = claims[claims["role"] == "primary"]
    labels = list(settings["setting"])
    rungs = list(settings.loc[settings["rung"], "setting"])
    by_id = trend.set_index("claim_id")
    text = {c.id: c.text for c in CLAIMS}
    rows = []
    for cid in lad.ORDER:
        cells = []
        for label in labels:
            r = prim[(prim["claim_id"] == cid) & (prim["setting"] == label)]
            measured = f"{r['measured'].iloc[0]}, {signed(r['mean'].iloc[0])}" if len(r) \
                else "n/a"
            cells.append(measured if descriptive or not len(r)
                         else f"**{r['verdict'].iloc[0]}** ({measured})")
        trend_text = lad.trend_cell(by_id.loc[cid]) if cid in by_id.index else "n/a"
        rows.append([f"{cid} {text[cid]}", *cells[:len(rungs)], trend_text,
                     *cells[len(rungs):]])
    head = ["claim", *map(md_text, rungs), "trend with width",
            *map(md_text, labels[len(rungs):])]
    trows = [[f"{r.claim_id} {r.claim}", f"`{r.statistic}`", r.widths, f"{r.k_up}/{r.n}",
              with_ci(r.mean_slope, r.ci_low, r.ci_high), md_text(r.width_means),
              fmt_p(r.p_adj),
              f"**{r.verdict}**" + (f" ({r.direction})" if r.direction else "")]
             for r in trend.itertuples()]
    parts = [
        "## Verdict by width", "",
        "Each setting's primary rows from its own runs with the usual rule (the six "
        "Holm-adjusted together; cell: verdict, runs with the predicted sign, mean over "
        "runs); the trend column: the test below. Settings other than the rungs (the arms) "
        "are shown on the right, their runs never pooled with a rung's. Protocol: "
        "`docs/protocols.md#the-width-ladder`.", "",
        md_table(head, rows), "",
        "## Trend with width", "",
        "Per seed, the OLS slope of the seed's run-level value on log₂ width over the rungs "
        "(at least two); the exact two-sided sign-flip test of the mean slope over seeds; "
        "Holm over the six claims (the unadjusted p: `ladder_trend.csv`). *moves with width* when the adjusted p < 0.05, with its "
        "direction (toward or away from the claim's predicted sign); otherwise *no trend "
        "detected* (no smallest trend of interest is declared: this is not \"no effect\"). "
        "With three rungs evenly spaced in log₂ width the slope is half the difference "
        "between the outer rungs. File: `ladder_trend.csv` (per seed and setting: "
        "`ladder_seed_effects.csv`).", "",
        md_table(["claim", "statistic", "widths", "seeds with slope > 0",
                  "mean slope per doubling [95 % t]", "mean per width",
                  "p (two-sided, Holm)", "trend"], trows)]
    if len(arms):
        arows = [[md_text(r.setting), md_text(r.rung_setting), r.claim_id, f"`{r.statistic}`",
                  f"{r.k_up}/{r.n}", with_ci(r.mean, r.ci_low, r.ci_high)]
                 for r in arms.itertuples()]
        parts += ["", "## Arms against their rung (descriptive)", "",
                  "Each arm's primary statistics minus the rung of its width, paired by seed "
                  "(seeds both have): the mean difference with its 95 % t-interval and the "
                  "seeds where it is positive. Descriptive: no p, no verdict. File: "
                  "`ladder_arms.csv`.", "",
                  md_table(["arm", "against", "claim", "statistic", "seeds with arm > rung",
                            "mean arm − rung [95 % t]"], arows)]
    return "\n".join(parts)


def setting_sections(claims: pd.DataFrame, settings: pd.DataFrame) -> list[str]:
    """Each ladder setting's own claims table (the layer-mean rows)."""
    parts = []
    for r in settings.itertuples():
        rows = layer_mean_rows(claims[claims["setting"] == r.setting])
        runs = f"{r.runs} run" + ("" if r.runs == 1 else "s")
        parts += [f"## Claims at {md_text(r.setting)} ({runs})", "",
                  summary_markdown(rows), "", claims_markdown(rows), ""]
    return parts


def _setup(data: Collated, traj: pd.DataFrame) -> str:
    """The shared setup section with E1's own lines: the layer trajectories the
    statistics count and the reference probe they start from."""
    _, inc, trained, monitored = run_groups(data)
    if not len(inc):
        return setup_markdown(data)
    per = inc.groupby(["depth", "qk_init", "variant"])["seed"].nunique()
    cells = int(inc.drop_duplicates(["depth", "qk_init", "variant"])["depth"].sum())
    what = "model" if len(monitored) and not len(trained) else "init"
    seeds = f"**Seeds per depth × init**: {per.min()}–{per.max()}; " if len(trained) else ""
    label = "**trajectories**" if seeds else "**Trajectories**"
    used = sorted(traj.loc[traj["origin"] == "reference", "start_step"].unique()) \
        if len(traj) else []
    return setup_markdown(
        data, unit_line=f"- {seeds}{label} (depth × {what} × layer): {cells}",
        reference_line=f"- **Reference step** (configured): {distinct(inc['ref_step'])}; first "
                       f"probe at or after it (used): {', '.join(map(str, used)) or 'n/a'}")


def report_markdown(data: Collated, e1: dict[str, pd.DataFrame], figs: Drawn) -> str:
    """The E1/E2 ``report.md`` from :func:`e1_claims`'s tables and the figures drawn."""
    table, name = data.metrics, data.name
    claims, settings = e1["claims"], e1["settings"]
    ladder = len(settings) > 0
    descriptive = descriptive_reason(claims)
    opening = (f"> **{lad.ladder_summary(claims, e1['trend'], settings)}**" if ladder
               else summary_markdown(claims))
    parts = [f"# qkgeom report: {md_text(name)}", ""]
    single = is_run_folder(data.folder)
    if single:  # one run: its health first, the paper's claims after, where measurable
        parts += [health_markdown(run_health(data.folder)), "## The paper's claims", ""]
    parts += [opening, ""]
    if descriptive:
        parts += [f"**{descriptive}**", ""]
    if ladder:
        parts += [ladder_markdown(e1, bool(descriptive)), "",
                  *setting_sections(claims, settings)]
    else:
        rows = layer_mean_rows(claims)
        measured = rows[pd.to_numeric(rows["n"], errors="coerce").fillna(0) > 0] \
            if single else rows
        parts += [claims_markdown(measured), ""]
        if len(measured) < len(rows):
            parts += [f"{len(rows) - len(measured)} of {len(rows)} claim rows measure "
                      "nothing on this run (listed with their reason in `claims.csv`).", ""]
    parts += [_rules_text(), ""]
    used = dict.fromkeys(m for level in LEVELS for m in level_metrics(level).values())
    note = metrics_note(missing_metrics(table, used) if len(table) else [],
                        "The claim rows that need them measure no run (0/0)" +
                        ("." if descriptive else " and read *not evaluated*."))
    if note:
        parts += [note, ""]
    caveats = _caveats(e1["run_layers"])
    if caveats:
        parts += [*caveats, ""]
    parts += ["Claims: E1, E2 (see `docs/definitions.md`; protocol: `docs/protocols.md`). "
              "Numbers: `claims.csv` (this table" + (", every setting's rows with its "
              "`setting`" if ladder else "") + "; per-layer rows: column `layer`), "
              "`run_stats.csv` (one row per run: the unit of the tests), `cell_stats.csv`, "
              "`trajectory_stats.csv` (seed-averaged layers) and `trajectory_stats_runs.csv` "
              "(per run and layer).", ""]
    per_layer = claims[pd.to_numeric(claims["n"], errors="coerce").fillna(0) > 0] \
        if single else claims  # one run: the layers it measured
    for section in (per_layer_markdown(per_layer, bool(descriptive)),
                    sensitivity_markdown(e1["sensitivity"], settings),
                    readings_markdown(e1["readings"], bool(descriptive))):
        if section:
            parts += [section, ""]
    parts += [_setup(data, e1["trajectories"]), "", excluded_markdown(data), ""]
    parts += _figures_markdown(figs)
    return "\n".join(parts).rstrip() + "\n"


def write_e1_report(data: Collated, out: Path, figures: bool = True) -> Path:
    """The E1/E2 report of a collated sweep or run folder into ``out``; returns the path
    of ``report.md``."""
    e1 = e1_claims(data)
    files = [("claims", e1["claims"]), ("contrast_readings", e1["readings"]),
             ("run_stats", e1["runs"]), ("cell_stats", e1["cells"]),
             ("trajectory_stats", e1["trajectories"]),
             ("trajectory_stats_runs", e1["run_layers"]),
             ("reference_sensitivity", e1["sensitivity"]),
             ("reference_sensitivity_runs", e1["sensitivity_runs"])]
    if len(e1["settings"]):
        files += [("ladder_settings", e1["settings"]), ("ladder_trend", e1["trend"]),
                  ("ladder_seed_effects", e1["seed_effects"]), ("ladder_arms", e1["arms"])]
    write_csvs(out, files)
    figs = Drawn(asked=figures)
    if figures and not data.metrics.empty:
        from qkgeom.analysis.e1.figures import make_figures  # matplotlib: only to draw

        figs = make_figures(data, out, e1)
    return write_pages(out, report_markdown(data, e1, figs), f"qkgeom report: {data.name}")
