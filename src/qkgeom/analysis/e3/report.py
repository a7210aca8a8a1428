"""The E3 report (:func:`qkgeom.analysis.e3.arms.is_e3` sweeps): the manipulation check
first, then the claims, the power of the primary rows, the mediation table, every paired
effect, the runs left out of the pairs, setup, excluded runs, figures. Files:
docs/report.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.collate import Collated
from qkgeom.analysis.e3.claims import MEDIATION_QUANTITIES, raw_entropy_lines
from qkgeom.analysis.e3.evaluate import e3_analysis
from qkgeom.analysis.e3.manipulation import EXEMPT, GATED, RECORD_RATIOS
from qkgeom.analysis.e3.paired import EARLY_SHARE, QUANTITIES
from qkgeom.analysis.kit import (
    SWEEP_CLAIM_CELLS,
    Cell,
    Drawn,
    claims_markdown,
    descriptive_reason,
    excluded_markdown,
    figure_markdown,
    fmt_p,
    md_table,
    md_text,
    primary_rows,
    setup_markdown,
    signed,
    summary_markdown,
    with_ci,
    write_csvs,
    write_pages,
)

#: Captions; ``{spread}`` is how the seeds are shown (figstyle.spread_note).
CAPTIONS = {
    "e3_trajectories": "Whole-model (layer mean) quantities against training step, one line "
                       "per arm (colour: mode; dashed: weight-level control): {spread}. "
                       "Dotted line: end of the early window (25 % of the run).",
    "e3_paired": "Paired differences (arm − none, same seed) against step: thin lines one "
                 "seed each, thick line the seed mean; below zero = lower than without "
                 "control. Dotted line: end of the early window.",
}


#: The E3 claims table: the shared layout, then the verdict protocol 1's manipulation gate
#: would have given (beside; the log-scale gate decides).
E3_CLAIM_CELLS: tuple[Cell, ...] = (
    *SWEEP_CLAIM_CELLS,
    ("verdict under protocol 1's gate", lambda r: r.get("verdict_gate_p1", "")))

#: Up to this many seeds the manipulation table lists each seed's value; above, a list
#: would fill the page, so it gives the median and range (each seed: e3_manipulation.csv).
LIST_SEEDS = 8


def _values(x: pd.Series) -> str:
    v = pd.to_numeric(x, errors="coerce").to_numpy(dtype=float)
    ok = v[np.isfinite(v)]
    if len(v) > LIST_SEEDS and len(ok):
        missing = f"; {len(v) - len(ok)} n/a" if len(ok) < len(v) else ""
        return (f"median {np.median(ok):.3f} [{ok.min():.3f}, {ok.max():.3f}] over "
                f"{len(ok)} seeds{missing}")
    return ", ".join("n/a" if not np.isfinite(a) else f"{a:.3f}" for a in v)


def _section(title: str, rows: list[list], header: list[str], intro: str,
             empty: str) -> str:
    """A report section: its title, then the intro and the table, or ``empty``."""
    body = [empty] if not rows else [intro, "", md_table(header, rows)]
    return "\n".join([f"## {title}", "", *body])


def _status(mode: str, gate: dict[tuple[str, str], str], key: tuple[str, str]) -> str:
    if mode not in GATED:
        return "reported (not gated)"
    return f"not evaluated: {gate[key]}" if key in gate else "passed"


def manipulation_markdown(man: pd.DataFrame, gate: dict[tuple[str, str], str],
                          gate_p1: dict[tuple[str, str], str] | None = None) -> str:
    """The check per arm and window: each seed's achieved token-level PR_K ratio (the mean
    over its units), the weight-level and pr_qk ratios beside, the intended ratio, the
    share of the log change achieved, the units that passed the log-scale gate (which
    decides) and protocol 1's plain-ratio gate (beside), and whether the arm's claims are
    read under each."""
    rows = []
    for (arm, window), g in man.groupby(["arm", "window"], sort=True):
        mode = str(g["mode"].iloc[0])
        units = (f"{int(g['units_passed'].sum())}/{int(g['checked'].sum())}"
                 if mode in GATED else "—")
        units_p1 = (f"{int(g['units_passed_p1'].sum())}/{int(g['checked'].sum())}"
                    if mode in GATED else "—")
        rows.append([arm, window, _values(g["achieved"]), _values(g["achieved_weight"]),
                     _values(g["qk_ratio"]), _values(g["intended"]), _values(g["log_share"]),
                     units, units_p1, _values(g["bound_share"]),
                     _status(mode, gate, (arm, window)),
                     _status(mode, gate if gate_p1 is None else gate_p1, (arm, window))])
    return _section(
        "Manipulation check (read first)", rows,
        ["arm", "window", "token PR_K ratio (per seed)", "weight PR_K ratio", "pr_qk ratio",
         "intended", "share of the log change", "units passed", "units passed (protocol 1)",
         "bound share", "claims", "claims under protocol 1's gate"],
        "Achieved = mean over the window's probes of PR_K(arm) ÷ PR_K(none, same seed) at "
        "the **token level** (the keys attention uses, on the probe set), for each unit the "
        "control sets (a layer, or a head), then averaged over the units for this table "
        "(per unit: the manipulation record below and `e3_manipulation_units.csv`); the "
        "weight-level PR_K ratio and the token-level pr_qk ratio beside. Intended: the "
        "recorded dose r(t) averaged over the window (shrink, expand), PR_K(arm, step 0) ÷ "
        "PR_K(none, t) averaged over the window (hold), 1 (sham). Share of the log change: "
        "ln achieved ÷ ln intended. A unit passes when it achieved at least half the "
        "intended change **on the log scale** in the intended direction (≤ √intended below "
        f"1, ≥ above; protocol 2); a unit within {EXEMPT:.0%} of 1 is not checked. An arm's "
        "claims in a window are *not evaluated* unless every checked unit of every seed "
        "passed. Beside it, protocol 1's gate (halfway on the plain ratio, ≤ (1 + "
        "intended)/2 below 1, ≥ above) and what it would have decided; it decides nothing. "
        "Sham and expand arms are reported, not gated (the sham should stay at ≈ 1). Bound "
        "share: the recorded share of steps the cap bound (hold: the reshape changed the "
        f"spectrum). Each seed's value is listed up to {LIST_SEEDS} seeds; above, the median "
        "[min, max] over seeds (each seed: `e3_manipulation.csv`).",
        "No controlled run is paired with an uncontrolled run: nothing to check.")


def record_markdown(units: pd.DataFrame) -> str:
    """The manipulation record per arm, window and unit: the intended ratio, the control's
    own PR records (in sample on Σ_ε, without ε, out of sample) and the probe set's, each
    ÷ the none run's probe PR_K at the same step; per seed (n/a: not recorded). "" when
    no controlled run is paired."""
    if units.empty:
        return ""
    rows = []
    for (arm, window, unit), g in units.groupby(["arm", "window", "unit"], sort=True):
        g = g.sort_values("seed")
        gated = str(g["mode"].iloc[0]) in GATED
        passed = (f"{int(g['passed'].eq(True).sum())}/{int(g['passed'].notna().sum())}, "
                  f"{int(g['passed_p1'].eq(True).sum())}/{int(g['passed_p1'].notna().sum())}"
                  if gated else "—")
        rows.append([arm, window, unit, _values(g["intended"]),
                     *(_values(g[c]) for c in RECORD_RATIOS), _values(g["achieved"]),
                     _values(g["log_share"]), passed])
    return _section(
        "The manipulation record, per unit", rows,
        ["arm", "window", "unit", "intended", "control, in sample on Σ_ε",
         "control, in sample without ε", "control, out of sample (next batch)",
         "probe set (achieved)", "share of the log change", "seeds passed (log, protocol 1)"],
        "What the control believed it did beside what the keys did, per unit and seed, "
        "every ratio ÷ the same denominator, the none run's probe-set token PR_K of the unit "
        "at the same step, averaged over the window's probes: the control's own PR record "
        "`ctl_pr` (on the Σ_ε its reshape was fitted to: on target by construction), "
        "`ctl_pr_raw` (the same keys on its Σ without ε), `ctl_pr_oos` (on the next training "
        "batch's inputs, without ε) and the probe set's `pr_k_token`, which alone is gated. "
        "n/a: the run did not record it (runs from before protocol 2 have no `ctl_pr_raw` "
        "or `ctl_pr_oos`; weight-level arms). Values per seed as above; every number: "
        "`e3_manipulation_units.csv`.",
        "")


def mediation_markdown(med: pd.DataFrame) -> str:
    """Raw entropy, scale-free entropy and the logit scales side by side, against none and
    against the sham."""
    rows = []
    for r in med.to_dict("records"):
        for b in ("none", "sham"):
            cells = [with_ci(r[f"{q}_vs_{b}_mean"], r[f"{q}_vs_{b}_ci_low"],
                             r[f"{q}_vs_{b}_ci_high"]) for q in MEDIATION_QUANTITIES]
            if b == "sham" and all(c.startswith("n/a") for c in cells):
                continue
            rows.append([r["arm"], r["window"], f"− {b}", *cells])
    return _section(
        "Mediation: does the sharpening come through the spectrum or the scale?", rows,
        ["arm", "window", "baseline", "entropy Δ", "scale-free entropy Δ",
         "within-row logit scale Δ", "pooled logit scale Δ"],
        "Per arm and window, mean over seeds [95 % t-interval] of the paired effect on the "
        "attention entropy, on the **scale-free entropy** (each row's logits divided by "
        "their own standard deviation before the softmax, so a change of temperature leaves "
        "it unchanged), on the within-row logit scale (the mean over queries of the standard "
        "deviation of the row's logits: what sets a row's sharpness) and on the pooled "
        "`logit_std` (which also holds the spread between rows). A sharpening through the "
        "key spectrum is one that survives in the scale-free entropy; an entropy effect "
        "that goes with a within-row scale effect and leaves the scale-free entropy "
        "unchanged is a change of temperature.",
        "No paired effects.")


def effects_markdown(eff: pd.DataFrame) -> str:
    """Every arm × baseline × quantity × window with its tests."""
    rows = []
    for r in eff.sort_values(["arm", "baseline", "quantity", "window"]).itertuples():
        level, label = QUANTITIES[r.quantity]
        pred = {1: "Δ > 0", -1: "Δ < 0"}.get(int(r.predicted), "")
        equiv = (f"{fmt_p(r.p_equiv)} (±{r.delta:g})" if np.isfinite(r.delta) else "—")
        rows.append([r.arm, f"− {r.baseline}", label, level, r.window,
                     f"{r.first_step}–{r.last_step}", with_ci(r.mean, r.ci_low, r.ci_high),
                     f"{100 * r.rel_mean:+.2f} %" if np.isfinite(r.rel_mean) else "n/a", pred,
                     f"{int(r.k)}/{int(r.n_seeds)}", fmt_p(r.p_value),
                     equiv, signed(r.detectable)])
    return _section(
        "Paired effects, per seed then across seeds", rows,
        ["arm", "baseline", "quantity", "level", "window", "steps", "mean Δ [95 % t]",
         "relative Δ", "predicted", "seeds", "p (sign-flip)",
         "p (equivalence, δ)", "detectable"],
        "Each seed's effect is its mean paired difference over the window's probes; the "
        "table gives the mean over seeds with its 95 % t-interval, the mean relative "
        "difference (Δ / baseline), seeds with the predicted sign, the exact one-sided "
        "sign-flip p (unadjusted: these rows decide nothing; the sign test's p is in "
        "`e3_effects.csv`), the equivalence p (two "
        "one-sided t-tests within ±δ, entropies only) and the smallest effect these seeds "
        "find with 80 % power at their own spread. Where no direction is predicted (blank "
        "*predicted*), the count is of seeds with Δ > 0 and both p's are two-sided.",
        "No controlled run has an uncontrolled partner with the same config.")


def power_markdown(claims: pd.DataFrame) -> str:
    """What the design could see: per primary row, the seeds, the effect the seeds find
    with 80 % power at their spread, and (entropy rows) the smallest effect of interest."""
    rows = []
    for r in primary_rows(claims).to_dict("records"):
        if not r["n"]:
            continue
        rows.append([r["claim_id"], r["claim"], int(r["n"]), signed(r["detectable"]),
                     f"±{r['delta']:g}" if np.isfinite(r["delta"]) else "—", r["verdict"]])
    return _section(
        "Power of the primary rows", rows,
        ["claim", "row", "seeds", "detectable effect (80 % power)", "δ (no effect larger)",
         "verdict"],
        "Detectable: the smallest true mean effect a one-sided t-test at α = 0.05 over "
        "these seeds finds with 80 % power, at the spread the seeds show. An *inconclusive* "
        "row whose detectable effect is larger than δ was too small a design to tell; "
        "docs/protocols.md gives the seed count the power calculation asked for.",
        "No primary row could be read.")


def _excluded_pairs_markdown(ex: pd.DataFrame) -> str:
    if ex.empty:
        return ""
    return _section("Runs left out of the pairs",
                    [[f"`{r.run_id}`", r.seed, r.arm, r.reason] for r in ex.itertuples()],
                    ["run", "seed", "arm", "reason"],
                    "These runs could not be paired; they are in no effect or claim.", "")


def _rules_text() -> str:
    return (
        "The unit is the seed (a pair group: runs whose configs agree on everything but the "
        "key control, so they share init and data order). Each arm is paired with the "
        "group's uncontrolled run (and with its sham), and a seed's effect in a window is "
        f"the mean of the paired differences at the probes with 0 < step ≤ {EARLY_SHARE:.0%} "
        "of the run (*first 25 %*) or ≤ the last step (*whole run*); step 0 is left out "
        "(the pair is identical there). Whole-model quantities are the mean over layers. "
        "Each claim has one **primary** row, declared in `docs/protocols.md` before any run "
        f"(the token-level arm with the data rule, against none, over the whole run, on "
        f"the scale-free entropy or pr_qk_token), tested at α = {stats.ALPHA}; every other "
        "row is **secondary**: its p's are Holm-adjusted over all secondary rows and it "
        "does not decide the claim. Verdicts (`qkgeom.analysis.stats.verdict`): **supported** "
        f"= the predicted direction significant (exact one-sided sign-flip p < {stats.ALPHA}) "
        f"in ≥ {stats.SUPPORT_SHARE:.0%} of seeds; **mixed** = significant but in fewer "
        "seeds; **equivalent to no effect** = the 90 % t-interval inside ±δ (two one-sided "
        f"t-tests; entropy rows: δ = 0.1 nats) on at least {stats.MIN_UNITS} seeds; **not "
        "supported** = the opposite direction significant; **inconclusive** = none of these "
        "(too few seeds to tell an effect from its absence); **not evaluated** = no seed, or "
        "the arm failed its manipulation check (reason given; the log-scale gate decides, "
        "the verdict under protocol 1's plain-ratio gate is shown beside). Intervals: 95 % "
        "t-intervals over seeds. Protocol: `docs/protocols.md` (protocol 2)."
    )


def e3_report_markdown(data: Collated, analysis: dict[str, pd.DataFrame], figs: Drawn) -> str:
    """The E3 ``report.md`` from :func:`~qkgeom.analysis.e3.evaluate.e3_analysis`'s tables
    and the figures drawn."""
    name = data.name
    members = analysis["members"]
    per_arm = members.groupby("arm")["seed"].nunique().to_dict() if len(members) else {}
    gate = analysis["gate"]
    beside = raw_entropy_lines(analysis["claims"])
    parts = [f"# qkgeom report: {md_text(name)}", "", summary_markdown(analysis["claims"]), "",
             *([f"- {md_text(line)}" for line in beside] + [""] if beside else []),
             "E3 (see `docs/definitions.md`): key-spectrum control during training, each arm "
             "paired with the uncontrolled run of its seed. Seeds per arm: "
             + (", ".join(f"{m} {n}" for m, n in sorted(per_arm.items())) or "none") + ".", "",
             manipulation_markdown(analysis["manipulation"], gate, analysis.get("gate_p1")),
             "", *([record, ""] if (record := record_markdown(
                 analysis["manipulation_units"])) else []),
             "## Claims", "",
             *([f"**{why}**", ""] if (why := descriptive_reason(analysis["claims"])) else []),
             claims_markdown(analysis["claims"], SWEEP_CLAIM_CELLS if why else E3_CLAIM_CELLS),
             "", _rules_text(), "",
             "Numbers: `claims.csv` (this table), `e3_manipulation.csv` (per seed), "
             "`e3_manipulation_units.csv` (per seed and unit), `e3_effects.csv`, "
             "`e3_mediation.csv`, `e3_windows.csv` (per seed), `e3_paired.csv` (per seed and "
             "probe), `e3_arms.csv`.", "",
             power_markdown(analysis["claims"]), "",
             mediation_markdown(analysis["mediation"]), "",
             effects_markdown(analysis["effects"]), ""]
    excluded_pairs = _excluded_pairs_markdown(analysis["excluded_pairs"])
    if excluded_pairs:
        parts += [excluded_pairs, ""]
    parts += [setup_markdown(data), "", excluded_markdown(data), "", "## Figures", ""]
    if not figs.pngs:
        parts.append("No figures: no controlled run could be paired." if figs.asked else
                     "No figures: not drawn (`figures=False`).")
    for key, png in figs.pngs.items():
        title = "E3 " + key.replace("e3_", "").replace("_", " ")
        parts += [*figure_markdown(png, CAPTIONS[key].format(spread=figs.spread), title), ""]
    return "\n".join(parts).rstrip() + "\n"


def write_e3_report(data: Collated, out: Path, figures: bool = True) -> Path:
    """The E3 report of a collated sweep into ``out``; returns ``report.md``."""
    analysis = e3_analysis(data)
    write_csvs(out, ((fname, analysis[key]) for fname, key in (
        ("claims", "claims"), ("e3_manipulation", "manipulation"),
        ("e3_manipulation_units", "manipulation_units"), ("e3_effects", "effects"),
        ("e3_mediation", "mediation"), ("e3_windows", "windows"), ("e3_paired", "paired"),
        ("e3_arms", "arms"))))
    figs = Drawn(asked=figures)
    if figures and not analysis["paired"].empty:
        from qkgeom.analysis.e3.figures import make_e3_figures  # matplotlib: only to draw

        figs = make_e3_figures(analysis, out)
    text = e3_report_markdown(data, analysis, figs)
    return write_pages(out, text, f"qkgeom report: {data.name}")
