"""The E1/E2 report of a sweep or of one run folder: claims table first, then setup,
excluded runs, figures.

:func:`write_e1_report` writes ``report.md`` (opens with the claims table), a
self-contained ``report.html`` (figures embedded), the figures as PNG (300 dpi) and SVG,
and the numbers behind the table as CSV (``claims.csv``, ``trajectory_stats.csv``,
``trajectory_stats_runs.csv``, ``bootstrap.csv``). A folder that records only some metrics
(a monitored run) gets the claims it can measure; the others read *not evaluated* and the
figures it cannot draw are listed as skipped. Reached through
:func:`qkgeom.analysis.report.write_report`.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.e1.claims import evaluate_claims
from qkgeom.analysis.kit import (
    claims_markdown,
    excluded_markdown,
    md_text,
    metrics_note,
    missing_metrics,
    setup_markdown,
    write_csvs,
    write_pages,
)

FIGURE_TITLES = {
    "pr": "(a) PR_Q and PR_K", "contrast": "(b) Paired contrast PR_Q − PR_K",
    "qk_entropy": "(c) Interaction PR and attention entropy",
    "heads": "(d) Heads: interaction PR vs attention entropy",
}
CAPTIONS = {
    "pr": "PR_Q (top row of each depth) and PR_K (bottom row) against training step; seed "
          "mean ± 95 % t-interval; one colour per layer; dashed line: reference step.",
    "contrast": "Paired contrast PR_Q − PR_K per layer (rows) and probe step (columns), "
                "seed mean; red = queries higher-dimensional than keys.",
    "qk_entropy": "PR of the interaction spectrum W_Q W_Kᵀ (upper row) and mean attention "
                  "entropy (lower row) against step; layer level (entropy: mean over heads).",
    "heads": "Every head of every run at every probe step: interaction PR against attention "
             "entropy, coloured by step.",
}


def e1_claims(table: pd.DataFrame, n_boot: int = stats.N_BOOT,
              rng_seed: int = stats.BOOT_SEED) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(claims, trajectory statistics, bootstrap CIs)`` of a collated table (see
    :func:`qkgeom.analysis.e1.claims.evaluate_claims`)."""
    if table.empty:
        empty = pd.DataFrame()
        return evaluate_claims(empty), empty, empty
    traj = stats.trajectory_stats(table)
    boot = stats.bootstrap_ci(table, n_boot=n_boot, rng_seed=rng_seed)
    return evaluate_claims(traj, boot), traj, boot


def _rules_text() -> str:
    return (
        f"Verdicts are computed by `qkgeom.analysis.stats.verdict`: **supported** = the "
        f"predicted sign in ≥ {stats.SUPPORT_SHARE:.0%} of trajectories (in all of them for "
        f"E1.3, a claim about *all* trajectories) and exact one-sided sign-test p < "
        f"{stats.ALPHA}; **not supported** = the predicted sign in ≤ {stats.FAIL_SHARE:.0%}; "
        "**mixed** otherwise. A zero counts against the claim. Each row says which origin it "
        "measures from: *step 0*, or the post-transient *reference* (first probe at or after "
        "the end of LR warm-up, or the configured `reference_step`; see "
        "`docs/definitions.md`). The bootstrap resamples "
        f"seeds with replacement within each depth × init ({stats.N_BOOT} resamples, fixed "
        "RNG seed) and recomputes the mean over trajectories. Layers of one run are not "
        "independent, so the sign test's p treats trajectories as more independent than they "
        "are; read it together with the seed-bootstrap CI."
    )


def _caveats(traj: pd.DataFrame) -> list[str]:
    out = []
    if len(traj) and (traj["n_heads"] < 3).any():
        out.append("- Layers with fewer than 3 heads make the across-head Spearman ρ (E2.3) "
                   "±1 by construction; read E2.3 as a sign only.")
    if len(traj) and (traj["n_seeds"] < 2).any():
        out.append("- Some depth × init groups have a single seed: no t-interval and a "
                   "degenerate bootstrap CI there.")
    if len(traj):
        short = traj[(traj["origin"] == "reference") & (traj["n_steps"] < 3)]
        if len(short):
            out.append("- From the reference step some trajectories have fewer than 3 probes; "
                       "their correlations are n/a.")
    return out


def _claim_metrics() -> list[str]:
    """Every metric the E1/E2 claims use, at both levels."""
    return list(dict.fromkeys(m for level in stats.LEVELS
                              for m in stats.level_metrics(level).values()))


def _figures_markdown(figures: dict[str, Path], gaps: dict[str, list[str]],
                      drawn: bool) -> list[str]:
    parts = ["## Figures", ""]
    if not figures and not gaps:
        parts.append("No figures: no run could be analysed." if drawn else
                     "No figures: not drawn (`figures=False`).")
    for key, png in figures.items():
        kind, level = key.rsplit("_", 1)
        parts += [f"### {FIGURE_TITLES[kind]} — {level} level", "",
                  f"[![{key}]({png.name})]({png.name})", "",
                  f"*{CAPTIONS[kind]} {level.capitalize()} level. Vector version: "
                  f"[{png.with_suffix('.svg').name}]({png.with_suffix('.svg').name}).*", ""]
    if gaps:
        parts += ["Skipped (their metrics are not recorded here): " + "; ".join(
            f"{FIGURE_TITLES[key.rsplit('_', 1)[0]]} — {key.rsplit('_', 1)[1]} level "
            f"(no {', '.join(f'`{m}`' for m in missing)})" for key, missing in gaps.items())
            + ".", ""]
    return parts


def report_markdown(table: pd.DataFrame, claims: pd.DataFrame, traj: pd.DataFrame,
                    figures: dict[str, Path], sweep_dir: Path,
                    gaps: dict[str, list[str]] | None = None, drawn: bool = True) -> str:
    """The E1/E2 ``report.md``: ``figures`` are the drawn ones, ``gaps`` the figures not
    drawn for want of metrics ({name: missing metrics}); ``drawn=False`` when figures were
    not asked for."""
    name = table.attrs.get("name") or sweep_dir.name
    parts = [f"# qkgeom report: {md_text(name)}", "", claims_markdown(claims), "",
             _rules_text(), ""]
    note = metrics_note(missing_metrics(table, _claim_metrics()) if len(table) else [],
                        "The claims that need them read *not evaluated* (0/0).")
    if note:
        parts += [note, ""]
    caveats = _caveats(traj)
    if caveats:
        parts += [*caveats, ""]
    parts += ["Claims: E1, E2 (see `docs/definitions.md`). Per-trajectory numbers: "
              "`trajectory_stats.csv` (seed-averaged) and `trajectory_stats_runs.csv` (per "
              "run); CIs: `bootstrap.csv`; this table: `claims.csv`.", ""]
    parts += [setup_markdown(table, sweep_dir, traj), "", excluded_markdown(table), ""]
    parts += _figures_markdown(figures, gaps or {}, drawn)
    return "\n".join(parts).rstrip() + "\n"


def write_e1_report(table: pd.DataFrame, sweep_dir: Path, out: Path,
                    n_boot: int = stats.N_BOOT, rng_seed: int = stats.BOOT_SEED,
                    figures: bool = True) -> Path:
    """The E1/E2 report of a collated ``table`` (a sweep or one run folder) into ``out``;
    returns the path of ``report.md``."""
    claims, traj, boot = e1_claims(table, n_boot, rng_seed)
    runs_traj = stats.trajectory_stats(table, by="run") if not table.empty else pd.DataFrame()
    write_csvs(out, (("claims", claims), ("trajectory_stats", traj),
                     ("trajectory_stats_runs", runs_traj), ("bootstrap", boot)))
    figs: dict[str, Path] = {}
    gaps: dict[str, list[str]] = {}
    if figures and not table.empty:
        from qkgeom.analysis.e1.figures import FIGURES, make_figures, missing_for

        gaps = {f"{kind}_{level}": missing for kind in FIGURES for level in stats.LEVELS
                if (missing := missing_for(table, kind, level))}
        figs = make_figures(table, out)
    text = report_markdown(table, claims, traj, figs, sweep_dir, gaps, drawn=figures)
    name = table.attrs.get("name") or sweep_dir.name
    return write_pages(out, text, f"qkgeom report: {name}")
