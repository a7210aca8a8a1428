"""The E3 report: the manipulation check first, then the claims, the mediation table, every
paired effect, the runs left out of the pairs, setup, excluded runs, figures.

Written by :func:`qkgeom.analysis.report.write_report` when the sweep is an E3 sweep
(:func:`qkgeom.analysis.e3.arms.is_e3`). Files: ``report.md``/``report.html``,
``claims.csv``, ``e3_manipulation.csv`` (the check per seed, arm and window),
``e3_effects.csv`` (every arm × baseline × quantity × window), ``e3_mediation.csv``,
``e3_windows.csv`` (each seed's window means), ``e3_paired.csv`` (paired differences at
every probe), ``e3_arms.csv`` and the two E3 figures.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.e3.analysis import e3_analysis
from qkgeom.analysis.e3.claims import with_ci
from qkgeom.analysis.e3.manipulation import GATED
from qkgeom.analysis.e3.paired import EARLY_SHARE, QUANTITIES
from qkgeom.analysis.kit import (
    claims_markdown,
    descriptive_reason,
    excluded_markdown,
    fmt_p,
    md_table,
    md_text,
    setup_markdown,
    summary_markdown,
    write_csvs,
    write_pages,
)

#: Captions; ``{spread}`` is how the seeds are shown (figstyle.spread_note).
CAPTIONS = {
    "e3_trajectories": "Whole-model (layer mean) quantities against training step, one line "
                       "per arm (colour: mode; dashed: frobenius scale rule): {spread}. "
                       "Dotted line: end of the early window (25 % of the run).",
    "e3_paired": "Paired differences (arm − none, same seed) against step: thin lines one "
                 "seed each, thick line the seed mean; below zero = lower than without "
                 "control. Dotted line: end of the early window.",
}


def _values(x: pd.Series) -> str:
    return ", ".join("n/a" if not np.isfinite(v) else f"{v:.3f}" for v in x)


def _section(title: str, rows: list[list], header: list[str], intro: str,
             empty: str) -> str:
    """A report section: its title, then the intro and the table, or ``empty``."""
    body = [empty] if not rows else [intro, "", md_table(header, rows)]
    return "\n".join([f"## {title}", "", *body])


def manipulation_markdown(man: pd.DataFrame, gate: dict[tuple[str, str], str]) -> str:
    """The check per arm and window: each seed's achieved PR_K ratio, the intended one, the
    threshold, the share of steps the cap bound, and whether the arm's claims are read."""
    rows = []
    for (arm, window), g in man.groupby(["arm", "window"], sort=True):
        mode = str(g["mode"].iloc[0])
        status = ("reported (not gated)" if mode not in GATED else
                  f"not evaluated: {gate[(arm, window)]}" if (arm, window) in gate else "passed")
        rows.append([arm, window, _values(g["achieved"]), _values(g["intended"]),
                     _values(g["threshold"]) if mode in GATED else "—",
                     _values(g["bound_share"]), status])
    return _section(
        "Manipulation check (read first)", rows,
        ["arm", "window", "achieved ratio per seed", "intended", "threshold", "bound share",
         "claims"],
        "Achieved = mean over the window's probes of PR_K(arm) ÷ PR_K(none, same seed), "
        "weight level, whole-model (mean over layers); one value per seed. Intended: the "
        "recorded dose r(t) averaged over the window (shrink, expand), PR_K(0) ÷ PR_K(none) "
        "averaged over the window (hold), 1 (sham). A shrink arm passes when achieved ≤ "
        "(1 + intended)/2 in every seed, a hold arm when achieved ≥ (1 + intended)/2; "
        "otherwise its claims in that window are *not evaluated*. Sham and expand arms are "
        "reported, not gated (the sham should stay at ≈ 1). Bound share: mean recorded "
        "`ctl_bound_share` (share of steps the cap bound).",
        "No controlled run is paired with an uncontrolled run: nothing to check.")


def mediation_markdown(med: pd.DataFrame) -> str:
    """Entropy and logit-scale effects side by side, against none and against the sham."""
    rows = []
    for r in med.to_dict("records"):
        cells = [with_ci(r[f"{q}_vs_{b}_mean"], r[f"{q}_vs_{b}_ci_low"],
                         r[f"{q}_vs_{b}_ci_high"])
                 for b in ("none", "sham") for q in ("attn_entropy", "logit_std")]
        rows.append([r["arm"], r["window"], *cells])
    return _section(
        "Mediation: attention entropy and the logit scale", rows,
        ["arm", "window", "entropy Δ vs none", "logit_std Δ vs none", "entropy Δ vs sham",
         "logit_std Δ vs sham"],
        "Does an arm sharpen attention only by changing the logit scale? Per arm and window, "
        "the entropy effect next to the logit-scale (`logit_std`) effect, mean over seeds "
        "[95 % t-interval], against none and against the sham of the same scale rule. Under "
        "the `data` scale rule the control keeps the keys' mean squared norm on the data, so "
        "an entropy effect there with a logit-scale effect near 0 is not a scale effect.",
        "No paired effects.")


def effects_markdown(eff: pd.DataFrame) -> str:
    """Every arm × baseline × quantity × window with its tests."""
    rows = []
    for r in eff.sort_values(["arm", "baseline", "quantity", "window"]).itertuples():
        _, level, label = QUANTITIES[r.quantity]
        pred = {1: "Δ > 0", -1: "Δ < 0"}.get(int(r.predicted), "")
        rows.append([r.arm, f"− {r.baseline}", label, level, r.window,
                     f"{r.first_step}–{r.last_step}", with_ci(r.mean, r.ci_low, r.ci_high),
                     f"{100 * r.rel_mean:+.2f} %" if np.isfinite(r.rel_mean) else "n/a", pred,
                     f"{int(r.k)}/{int(r.n_seeds)}", fmt_p(r.p_value), fmt_p(r.p_sign)])
    return _section(
        "Paired effects, per seed then across seeds", rows,
        ["arm", "baseline", "quantity", "level", "window", "steps", "mean Δ [95 % t]",
         "relative Δ", "predicted", "seeds", "p (sign-flip)", "p (sign test)"],
        "Each seed's effect is its mean paired difference over the window's probes; the "
        "table gives the mean over seeds with its 95 % t-interval, the mean relative "
        "difference (Δ / baseline), seeds with the predicted sign, the exact one-sided "
        "sign-flip p and the exact sign-test p. Where no direction is predicted (blank "
        "*predicted*), the count is of seeds with Δ > 0 and both p's are two-sided.",
        "No controlled run has an uncontrolled partner with the same config.")


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
        f"Verdicts (`qkgeom.analysis.stats.verdict`): **supported** = the predicted sign in ≥ "
        f"{stats.SUPPORT_SHARE:.0%} of seeds and exact one-sided sign-flip p < {stats.ALPHA} "
        f"(with 5 seeds that needs 5/5: p = 1/32); **not supported** = ≤ "
        f"{stats.FAIL_SHARE:.0%}; **mixed** otherwise; **not evaluated** = no seed, or the "
        "arm failed its manipulation check (reason given). A zero counts against the claim. "
        "Intervals: 95 % t-intervals over seeds. Protocol: `docs/protocols.md`."
    )


def e3_report_markdown(table: pd.DataFrame, analysis: dict[str, pd.DataFrame],
                       figures: dict[str, Path], sweep_dir: Path, drawn: bool = True,
                       spread: str = "") -> str:
    """The E3 ``report.md``, opening with the one-line summary; ``spread`` says how the
    figures show the seeds; ``drawn=False`` when figures were not asked for."""
    name = table.attrs.get("name") or sweep_dir.name
    members = analysis["members"]
    per_arm = members.groupby("arm")["seed"].nunique().to_dict() if len(members) else {}
    gate = analysis["claims"].attrs.get("gate", {})
    parts = [f"# qkgeom report: {md_text(name)}", "", summary_markdown(analysis["claims"]), "",
             "E3 (see `docs/definitions.md`): key-spectrum control during training, each arm "
             "paired with the uncontrolled run of its seed. Seeds per arm: "
             + (", ".join(f"{m} {n}" for m, n in sorted(per_arm.items())) or "none") + ".", "",
             manipulation_markdown(analysis["manipulation"], gate), "",
             "## Claims", "",
             *([f"**{why}**", ""] if (why := descriptive_reason(analysis["claims"])) else []),
             claims_markdown(analysis["claims"]), "", _rules_text(), "",
             "Numbers: `claims.csv` (this table), `e3_manipulation.csv`, `e3_effects.csv`, "
             "`e3_mediation.csv`, `e3_windows.csv` (per seed), `e3_paired.csv` (per seed and "
             "probe), `e3_arms.csv`.", "",
             mediation_markdown(analysis["mediation"]), "",
             effects_markdown(analysis["effects"]), ""]
    excluded_pairs = _excluded_pairs_markdown(analysis["excluded_pairs"])
    if excluded_pairs:
        parts += [excluded_pairs, ""]
    parts += [setup_markdown(table, sweep_dir, pd.DataFrame(), trajectories=False), "",
              excluded_markdown(table), "", "## Figures", ""]
    if not figures:
        parts.append("No figures: no controlled run could be paired." if drawn else
                     "No figures: not drawn (`figures=False`).")
    for key, png in figures.items():
        title = key.replace("e3_", "").replace("_", " ")
        parts += [f"### E3 {title}", "", f"[![{key}]({png.name})]({png.name})", "",
                  f"*{CAPTIONS[key].format(spread=spread)} Vector version: "
                  f"[{png.with_suffix('.svg').name}]({png.with_suffix('.svg').name}).*", ""]
    return "\n".join(parts).rstrip() + "\n"


def write_e3_report(table: pd.DataFrame, sweep_dir: Path, out: Path,
                    figures: bool = True) -> Path:
    """The E3 report of a collated sweep ``table`` into ``out``; returns ``report.md``."""
    analysis = e3_analysis(table)
    write_csvs(out, ((fname, analysis[key]) for fname, key in (
        ("claims", "claims"), ("e3_manipulation", "manipulation"), ("e3_effects", "effects"),
        ("e3_mediation", "mediation"), ("e3_windows", "windows"), ("e3_paired", "paired"),
        ("e3_arms", "arms"))))
    figs: dict[str, Path] = {}
    spread = ""
    if figures and not analysis["paired"].empty:
        from qkgeom.analysis.e3.figures import make_e3_figures, seeds_per_arm
        from qkgeom.analysis.figstyle import spread_note

        figs = make_e3_figures(analysis, out)
        spread = spread_note(seeds_per_arm(analysis["members"]))
    text = e3_report_markdown(table, analysis, figs, sweep_dir, drawn=figures, spread=spread)
    name = table.attrs.get("name") or sweep_dir.name
    return write_pages(out, text, f"qkgeom report: {name}")
