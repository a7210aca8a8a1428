"""The E1/E2 report of a sweep or of one run folder: the summary line and the claims table
first, then setup, excluded runs, figures; files: docs/report.md. A folder that records
only some metrics (a monitored run) gets the claims it can measure; the others read *not
evaluated* and the figures it cannot draw are listed as skipped.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.collate import Collated
from qkgeom.analysis.e1.claims import READINGS, contrast_readings, evaluate_claims
from qkgeom.analysis.e1.trajectories import (
    LEVELS,
    cell_stats,
    layer_statistics,
    level_metrics,
    run_stats,
)
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
    summary_markdown,
    with_ci,
    write_csvs,
    write_pages,
)

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
    could not be measured for want of recorded metrics names them in ``reason``),
    ``readings`` (E1.3 four ways), ``runs`` (one row per run, level and origin),
    ``cells``, ``trajectories`` (seed-averaged layers) and ``run_layers`` (per run and
    layer)."""
    if data.metrics.empty:
        per_layer = traj = pd.DataFrame()
    else:
        per_layer, traj = layer_statistics(data)
    runs = run_stats(per_layer)
    return {"claims": name_missing_metrics(evaluate_claims(per_layer, traj), data.metrics),
            "readings": contrast_readings(per_layer, traj), "runs": runs,
            "cells": cell_stats(runs), "trajectories": traj, "run_layers": per_layer}


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
        "whatever links them). Protocol: `docs/protocols.md`."
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
    for r in readings.sort_values(["level", "origin", "reading"],
                                  ascending=[False, True, True]).itertuples():
        label = f"**({r.reading})**" if r.primary else f"({r.reading})"
        rows.append([label, r.criterion, r.level, r.origin, f"{r.k}/{r.n}",
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
        "", md_table(["reading", "criterion (per layer)", "level", "origin", "runs",
                      "mean over runs [95 % t]", "p (sign-flip)", "cells",
                      "layer trajectories",
                      *([] if descriptive else ["verdict as a universal claim"])], rows)])


def _figure_name(key: str) -> str:
    kind, level = key.rsplit("_", 1)
    return f"{FIGURE_TITLES[kind]} — {level} level"


def _figures_markdown(figs: Drawn) -> list[str]:
    """The figures section: each drawn figure with its caption, then the figures skipped
    for want of metrics or because they would show nothing."""
    parts = ["## Figures", ""]
    if not (figs.pngs or figs.missing or figs.empty):
        parts.append("No figures: no run could be analysed." if figs.asked else
                     "No figures: not drawn (`figures=False`).")
    for key, png in figs.pngs.items():
        kind, level = key.rsplit("_", 1)
        caption = f"{CAPTIONS[kind].format(spread=figs.spread)} {level.capitalize()} level."
        parts += [*figure_markdown(png, caption, _figure_name(key)), ""]
    if figs.missing:
        parts += ["Skipped (their metrics are not recorded here): " + "; ".join(
            f"{_figure_name(key)} (no {', '.join(f'`{m}`' for m in missing)})"
            for key, missing in figs.missing.items()) + ".", ""]
    if figs.empty:
        parts += ["Not drawn (they would show nothing): " + "; ".join(
            f"{_figure_name(key)} ({why})" for key, why in figs.empty.items()) + ".", ""]
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
    descriptive = descriptive_reason(e1["claims"])
    parts = [f"# qkgeom report: {md_text(name)}", "", summary_markdown(e1["claims"]), ""]
    if descriptive:
        parts += [f"**{descriptive}**", ""]
    parts += [claims_markdown(e1["claims"]), "", _rules_text(), ""]
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
              "Numbers: `claims.csv` (this table), `run_stats.csv` (one row per run: the "
              "unit of the tests), `cell_stats.csv`, `trajectory_stats.csv` (seed-averaged "
              "layers) and `trajectory_stats_runs.csv` (per run and layer).", ""]
    readings = readings_markdown(e1["readings"], bool(descriptive))
    if readings:
        parts += [readings, ""]
    parts += [_setup(data, e1["trajectories"]), "", excluded_markdown(data), ""]
    parts += _figures_markdown(figs)
    return "\n".join(parts).rstrip() + "\n"


def write_e1_report(data: Collated, out: Path, figures: bool = True) -> Path:
    """The E1/E2 report of a collated sweep or run folder into ``out``; returns the path
    of ``report.md``."""
    e1 = e1_claims(data)
    write_csvs(out, (("claims", e1["claims"]), ("contrast_readings", e1["readings"]),
                     ("run_stats", e1["runs"]), ("cell_stats", e1["cells"]),
                     ("trajectory_stats", e1["trajectories"]),
                     ("trajectory_stats_runs", e1["run_layers"])))
    figs = Drawn(asked=figures)
    if figures and not data.metrics.empty:
        from qkgeom.analysis.e1.figures import make_figures  # matplotlib: only to draw

        figs = make_figures(data, out)
    return write_pages(out, report_markdown(data, e1, figs), f"qkgeom report: {data.name}")
