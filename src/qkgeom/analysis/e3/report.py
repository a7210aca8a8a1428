"""The E3 report: claims table first, then every paired effect, setup, excluded runs, figures.

Written by :func:`qkgeom.analysis.report.write_report` when the sweep is an E3 sweep (runs
with and without key control paired by seed, :func:`qkgeom.analysis.e3.paired.is_e3`). Files:
``report.md``/``report.html``, ``claims.csv``, ``e3_effects.csv`` (directional confidence of
every mode × quantity × window), ``e3_windows.csv`` (each seed's window means),
``e3_paired.csv`` (paired differences at every probe) and the two E3 figures.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.e3.paired import EARLY_SHARE, QUANTITIES, e3_analysis, run_modes
from qkgeom.analysis.kit import (
    claims_markdown,
    excluded_markdown,
    fmt_p,
    md_table,
    md_text,
    setup_markdown,
    signed,
    write_csvs,
    write_pages,
)

CAPTIONS = {
    "e3_trajectories": "Whole-model (layer mean) quantities against training step, one line "
                       "per key-control mode: seed mean ± 95 % t-interval over seeds. Dotted "
                       "line: end of the early phase (25 % of the run).",
    "e3_paired": "Paired differences (controlled − none, same seed) against step: thin lines "
                 "one seed each, thick line the seed mean; below zero = lower than without "
                 "control. Dotted line: end of the early phase.",
}


def effects_markdown(eff: pd.DataFrame) -> str:
    """Every mode × quantity × window with its directional confidence."""
    lines = ["## Paired effects (controlled − none), per seed then across seeds", ""]
    if eff.empty:
        lines.append("No controlled run has an uncontrolled partner of the same seed.")
        return "\n".join(lines)
    lines += [
        "Each seed's effect is its mean paired difference over the window's probes; the "
        "table gives the mean over seeds with its seed-bootstrap 95 % CI, the mean relative "
        "difference (Δ / none), and the directional confidence: seeds with the predicted "
        "sign and the exact one-sided sign-test p. Where the paper predicts no direction "
        "(blank *predicted*), the count is of seeds with Δ > 0 and p is two-sided.", ""]
    rows = []
    for r in eff.sort_values(["mode", "quantity", "window"]).itertuples():
        metric, level, label = QUANTITIES[r.quantity]
        pred = {1: "Δ > 0", -1: "Δ < 0"}.get(int(r.predicted), "")
        ci = f" [{signed(r.ci_low)}, {signed(r.ci_high)}]" if np.isfinite(r.ci_low) else ""
        rows.append([r.mode, label, level, r.window, f"{r.first_step}–{r.last_step}",
                     f"{signed(r.mean)}{ci}", f"{100 * r.rel_mean:+.2f} %"
                     if np.isfinite(r.rel_mean) else "n/a", pred,
                     f"{int(r.k)}/{int(r.n_seeds)}", fmt_p(r.p_value)])
    lines.append(md_table(["mode", "quantity", "level", "window", "steps",
                            "mean Δ [95 % CI]", "relative Δ", "predicted", "seeds", "p"], rows))
    return "\n".join(lines)


def _rules_text() -> str:
    return (
        "The unit of analysis is the seed: each controlled run is paired with the uncontrolled "
        "run of the same seed (same init and data order), and its effect in a window is the "
        f"mean of the paired differences at the probes with 0 < step ≤ {EARLY_SHARE:.0%} of "
        "the run (*first 25 %*) or ≤ the last step (*whole run*); step 0 is left out (the "
        "pair is identical there). Whole-model quantities are the mean over layers. "
        f"Verdicts (`qkgeom.analysis.stats.verdict`): **supported** = the predicted sign in ≥ "
        f"{stats.SUPPORT_SHARE:.0%} of seeds and exact one-sided sign-test p < {stats.ALPHA} "
        f"(with 5 seeds that needs 5/5: p = 1/32); **not supported** = ≤ "
        f"{stats.FAIL_SHARE:.0%}; **mixed** otherwise. A zero counts against the claim. CI: "
        f"{stats.N_BOOT} seed resamples with replacement, fixed RNG seed, percentile interval."
    )


def e3_report_markdown(table: pd.DataFrame, analysis: dict[str, pd.DataFrame],
                       figures: dict[str, Path], sweep_dir: Path, drawn: bool = True) -> str:
    """The E3 ``report.md``; ``drawn=False`` when figures were not asked for."""
    name = table.attrs.get("name") or sweep_dir.name
    modes = run_modes(table)
    per_mode = modes.groupby("mode")["seed"].nunique().to_dict() if len(modes) else {}
    parts = [f"# qkgeom report: {md_text(name)}", "",
             "E3 (see `docs/definitions.md`): key-spectrum control during training, paired by "
             "seed against the uncontrolled run. Seeds per mode: "
             + (", ".join(f"{m} {n}" for m, n in sorted(per_mode.items())) or "none") + ".", "",
             claims_markdown(analysis["claims"]), "", _rules_text(), "",
             "Numbers: `claims.csv` (this table), `e3_effects.csv`, `e3_windows.csv` (per "
             "seed), `e3_paired.csv` (per seed and probe).", "",
             effects_markdown(analysis["effects"]), "",
             setup_markdown(table, sweep_dir, pd.DataFrame(), trajectories=False), "",
             excluded_markdown(table), "", "## Figures", ""]
    if not figures:
        parts.append("No figures: no controlled run could be paired." if drawn else
                     "No figures: not drawn (`figures=False`).")
    for key, png in figures.items():
        title = key.replace("e3_", "").replace("_", " ")
        parts += [f"### E3 {title}", "", f"[![{key}]({png.name})]({png.name})", "",
                  f"*{CAPTIONS[key]} Vector version: "
                  f"[{png.with_suffix('.svg').name}]({png.with_suffix('.svg').name}).*", ""]
    return "\n".join(parts).rstrip() + "\n"


def write_e3_report(table: pd.DataFrame, sweep_dir: Path, out: Path,
                    n_boot: int = stats.N_BOOT, rng_seed: int = stats.BOOT_SEED,
                    figures: bool = True) -> Path:
    """The E3 report of a collated sweep ``table`` into ``out``; returns ``report.md``."""
    analysis = e3_analysis(table, n_boot, rng_seed)
    write_csvs(out, ((fname, analysis[key]) for fname, key in (
        ("claims", "claims"), ("e3_effects", "effects"), ("e3_windows", "windows"),
        ("e3_paired", "paired"))))
    figs: dict[str, Path] = {}
    if figures and not analysis["paired"].empty:
        from qkgeom.analysis.e3.figures import make_e3_figures

        steps = int(run_modes(table)["steps"].max())
        figs = make_e3_figures(analysis, steps, out)
    text = e3_report_markdown(table, analysis, figs, sweep_dir, drawn=figures)
    name = table.attrs.get("name") or sweep_dir.name
    return write_pages(out, text, f"qkgeom report: {name}")
