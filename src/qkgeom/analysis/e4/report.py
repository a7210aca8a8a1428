"""The E4 report of an analysis folder: a one-line summary and the claims table first,
then setup, tables, figures.

``write_e4_report(DIR)`` reads only the folder's JSON/Parquet (no torch, no model) and
writes ``DIR/report/``: ``report.md`` (summary line and claims table first),
``report.html`` (verdicts coloured, figures shown from their files), the figures (PNG
150 dpi + SVG; those that would show nothing, e.g. a trajectory of one checkpoint, are
listed instead) and the numbers as CSV (``claims.csv``,
``trends.csv`` (the regime call per contrast and layer), ``bootstrap.csv`` (the token-block
bootstrap of the primary contrast per layer), ``prefix_trends.csv``,
``head_correlations.csv``, ``checkpoints.csv``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.e4.bootstrap import N_BOOT, block_bootstrap
from qkgeom.analysis.e4.claims import e4_claims
from qkgeom.analysis.e4.labels import UNKNOWN_STEP, names_by_position
from qkgeom.analysis.e4.trends import (
    PRIMARY,
    TREND_METRICS,
    head_correlations,
    prefix_trends,
    trend_table,
)
from qkgeom.analysis.kit import (
    P_CELL,
    P_SIGN_CELL,
    VERDICT_CELL,
    Cell,
    claims_markdown,
    field,
    fmt_p,
    md_code,
    md_table,
    md_text,
    summary_markdown,
    write_csvs,
    write_pages,
)
from qkgeom.errors import QKGeomError
from qkgeom.io import read_json
from qkgeom.runs.family import CHECKPOINT_TABLE, MARKER

__all__ = ["E4_CLAIM_CELLS", "bootstrap", "e4_claims_table", "load_analysis", "write_e4_report"]

#: The E4 claims table in Markdown: what each row measured and its own test.
E4_CLAIM_CELLS: tuple[Cell, ...] = (
    ("level", field("level")), ("measured", field("measured")),
    ("estimate", field("estimate")), ("test", field("test")), P_CELL, P_SIGN_CELL,
    ("beside", field("beside")), VERDICT_CELL)
#: Figure captions of the report.
CAPTIONS = {
    "contrast_steps": "PR_Q − PR_K per layer against step (hollow: duplicate checkpoints, "
                      "left out of statistics); primary contrast with its 95 % token-block "
                      "bootstrap band; ◆ the peak.",
    "prefix_trend": "Descriptive: Mann–Kendall Z of the first k checkpoints against the k-th "
                    "step; dashed: one-sided p = 0.05; dotted: each layer's peak when it has "
                    "a regime.",
    "qk_entropy_heads": "Every head at each checkpoint: pr_qk (token level) against attention "
                        "entropy, coloured by layer.",
}


def load_analysis(folder: str | Path) -> dict:
    """The tables of an analysis folder: ``meta``, ``metrics`` (measured on all tokens:
    ``block`` −1, or every row of a folder without blocks), ``blocks`` (the per-block rows,
    maybe empty), ``checkpoints``; the statistics ``trends``, ``prefix``, ``heads`` are
    recomputed from the metrics (duplicates left out unless kept). The block bootstrap is
    not run here (:func:`bootstrap`)."""
    folder = Path(folder)
    if not (folder / MARKER).is_file():
        raise QKGeomError(f"{folder}: not an analysis folder (no {MARKER}); run "
                          "`qkgeom analyze ... --out DIR` first")
    meta = read_json(folder / MARKER)
    if not (folder / "metrics.parquet").is_file():
        raise QKGeomError(f"{folder}: the analysis has no metrics.parquet yet (state "
                          f"{meta.get('state')!r}); run `qkgeom analyze` again to finish it")
    metrics = pd.read_parquet(folder / "metrics.parquet")
    ckpts = pd.read_parquet(folder / CHECKPOINT_TABLE)
    blocks = metrics.iloc[0:0]
    if "block" in metrics:
        blocks = metrics[metrics["block"] >= 0]
        metrics = metrics[metrics["block"] < 0]
    used = metrics[metrics["in_trends"]]
    return {"meta": meta, "metrics": metrics, "blocks": blocks, "checkpoints": ckpts,
            "trends": trend_table(used), "prefix": prefix_trends(used),
            "heads": head_correlations(used)}


def bootstrap(analysis: dict, n_boot: int = N_BOOT) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The token-block bootstrap of the primary contrast of :func:`load_analysis`'s
    tables, on the checkpoints in the trends: ``(per layer, band)`` (empty without
    blocks)."""
    blocks = analysis["blocks"]
    used = analysis["metrics"]
    used = used[used["in_trends"] & (used["metric"] == PRIMARY) & (used["head"] == -1)]
    if blocks.empty or used.empty:
        return pd.DataFrame(), pd.DataFrame()
    steps = np.sort(used["step"].unique()).astype(float)
    return block_bootstrap(blocks[blocks["in_trends"]], steps, PRIMARY, n_boot)


def e4_claims_table(folder: str | Path, n_boot: int = N_BOOT) -> pd.DataFrame:
    """The E4 claims of an analysis folder (see :mod:`qkgeom.analysis.e4.claims`)."""
    a = load_analysis(folder)
    return e4_claims(a["trends"], a["heads"], bootstrap(a, n_boot)[0])


def _step_cell(step: float, source: str) -> str:
    """A checkpoint's step for a table: "—" when only its position is known (step_source
    ``order``: a pretrained model, a folder without a step), never a made-up "0"."""
    return "—" if source == UNKNOWN_STEP else str(int(step))


def _at(step: float, names: dict[float, str] | None) -> str:
    """Where a trend peaks: its step, or the checkpoint's name when no step is known."""
    return md_text(names.get(float(step), int(step))) if names else str(int(step))


def _f(x: float, fmt: str = "{:+.3f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and np.isfinite(x) else "n/a"


def _setup(meta: dict, ckpts: pd.DataFrame) -> str:
    s = meta["settings"]
    first = ckpts.iloc[0]
    lines = [
        f"- **model**: {md_code(meta['model'])} ({md_text(first['arch'])}, "
        f"{int(first['n_head'])} query heads, {int(first['n_kv_head'])} key heads per layer)",
        f"- **text**: {md_code(s['text'])}, first {s['max_tokens']:,} tokens, windows of "
        f"{int(first['seq_len'])} tokens; q/k site for token PRs: {md_code(s['qk_site'])}; "
        f"dtype {md_text(s['dtype'])}",
        f"- **checkpoints**: {len(ckpts)} (steps from "
        f"{md_text(', '.join(sorted(set(ckpts['step_source']))))}); mean "
        f"{ckpts['tokens_per_s'].mean():,.0f} tokens/s",
    ]
    dups = ckpts[ckpts["duplicate_of"].notna()]
    if len(dups):
        kept = "kept in the statistics (--keep-duplicates)" if meta.get("keep_duplicates") \
            else "left out of every trend statistic"
        lines.append(f"- **duplicates** (identical Q/K weights; {kept}): " + "; ".join(
            f"{md_code(r.checkpoint)} = {md_code(r.duplicate_of)}" for r in dups.itertuples()))
    else:
        lines.append("- **duplicates**: none (every checkpoint has distinct Q/K weights)")
    table = md_table(["checkpoint", "step", "Q/K hash", "duplicate of", "in trends",
                       "tokens/s"],
                      [[md_text(r.checkpoint), _step_cell(r.step, r.step_source),
                        md_text(r.qk_hash[:12]),
                        md_text(r.duplicate_of or ""), "yes" if r.in_trends else "no",
                        f"{r.tokens_per_s:,.0f}"]
                       for r in ckpts.sort_values("step").itertuples()])
    return "\n".join(lines) + "\n\n" + table


def _trend_md(trends: pd.DataFrame, boot: pd.DataFrame, ckpts: pd.DataFrame) -> str:
    names = names_by_position(ckpts)
    rows = []
    order = {lv: i for i, lv in enumerate(TREND_METRICS.values())}
    trends = trends.assign(_o=trends["level"].map(order)).sort_values(["_o", "layer"])
    for r in trends.itertuples():
        b = boot[boot["layer"] == r.layer] if len(boot) and r.metric == PRIMARY else boot.iloc[0:0]
        same = b[f"share_{r.call.replace(' ', '_')}"].iloc[0] if len(b) else np.nan
        lost = (f"{_f(r.share_lost, '{:.2f}')}" +
                (f" [{_f(b['share_lost_low'].iloc[0], '{:.2f}')}, "
                 f"{_f(b['share_lost_high'].iloc[0], '{:.2f}')}]" if len(b) else ""))
        peak = _at(r.peak_step, names) + (f" [{_at(b['peak_step_low'].iloc[0], names)}, "
                                          f"{_at(b['peak_step_high'].iloc[0], names)}]"
                                          if len(b) else "")
        rows.append([r.level, r.layer, r.n, _f(r.first), f"{_f(r.peak)} @ {peak}", _f(r.last),
                     f"**{r.call}**", fmt_p(r.p_rise), fmt_p(r.p_fall),
                     fmt_p(r.mk_p_increase), lost,
                     f"{same:.0%}" if np.isfinite(same) else "n/a"])
    return md_table(["level", "layer", "n", "contrast first", "peak @ step [95 % bootstrap]",
                     "last", "call", "p rise", "p fall", "p whole-run rise",
                     "share of gain lost [95 % bootstrap]", "resamples with this call"], rows)


def _heads_md(heads: pd.DataFrame, ckpts: pd.DataFrame) -> str:
    per_layer = heads[heads["layer"] >= 0]
    sources = dict(zip(ckpts["checkpoint"], ckpts["step_source"], strict=True))
    rows = []
    for (step, ckpt), g in per_layer.groupby(["step", "checkpoint"], sort=True):
        cells = [md_text(ckpt), _step_cell(step, sources.get(ckpt, UNKNOWN_STEP))]
        for level in ("token", "weight"):
            h = g[g["level"] == level]
            ct = stats.count_test(h["rho"], +1)
            pooled = heads[(heads["checkpoint"] == ckpt) & (heads["level"] == level)
                           & (heads["layer"] == -1)]["rho"]
            cells += [f"{ct['k']}/{ct['n']}" if ct["n"] else "n/a",
                      _f(h["rho"].mean(), "{:+.2f}") if len(h) else "n/a",
                      _f(pooled.iloc[0], "{:+.2f}") if len(pooled) else "n/a"]
        rows.append(cells)
    return md_table(["checkpoint", "step", "token: layers ρ > 0", "token: mean ρ",
                     "token: pooled ρ", "weight: layers ρ > 0", "weight: mean ρ",
                     "weight: pooled ρ"], rows)


def _rules_text(boot: pd.DataFrame) -> str:
    boot_line = (f"The token-block bootstrap ({int(boot['n_boot'].iloc[0])} resamples of the "
                 f"{int(boot['n_blocks'].iloc[0])} token blocks, fixed seed) recomputes each "
                 "layer's call on resampled trajectories of the primary contrast; it shows how "
                 "much a call depends on which tokens were read, and is descriptive (blocks of "
                 "one text are not independent samples of the model's behaviour)."
                 if len(boot) else
                 "No token blocks are recorded in this folder (`qkgeom analyze --blocks K`): no "
                 "bootstrap of the calls.")
    return (
        "**Unit: a layer of one model. Layers of one model are not independent**, so the "
        "p-values over layers describe rather than infer. Verdicts "
        f"(`qkgeom.analysis.stats.verdict`): supported = the predicted outcome in ≥ "
        f"{stats.SUPPORT_SHARE:.0%} of layers and p < {stats.ALPHA}; mixed = significant in "
        "fewer layers; inconclusive otherwise. E4.1 claims the trend is *not* universal: "
        "supported when at least one layer is not a monotone rise. Primary contrast: "
        f"`{PRIMARY}` (the mean over query heads of PR_Q^h − PR_K^g(h), fair under "
        "grouped-query attention); the other contrasts are shown beside. Regime call per "
        "layer: peak p = the checkpoint of the largest contrast; *rise then fall* = "
        "significant Mann–Kendall increase on [first, p] and decrease on [p, last] (α = "
        f"{stats.ALPHA}, ≥ 4 points each); *rise then flat* = the increase only; *monotone "
        "rise* = p is the last checkpoint and the whole run rises significantly; *none* "
        f"otherwise. {boot_line} Protocol: `docs/protocols.md`; definitions: "
        "`docs/checkpoints.md`."
    )


def write_e4_report(analysis_dir: str | Path, out: str | Path | None = None,
                    figures: bool = True, n_boot: int = N_BOOT) -> Path:
    """Write the E4 report of an analysis folder; returns the path of ``report.md``."""
    folder = Path(analysis_dir)
    a = load_analysis(folder)
    out = folder / "report" if out is None else Path(out)
    out.mkdir(parents=True, exist_ok=True)
    boot, band = bootstrap(a, n_boot)
    claims = e4_claims(a["trends"], a["heads"], boot)
    write_csvs(out, (("claims", claims), ("trends", a["trends"]), ("bootstrap", boot),
                     ("prefix_trends", a["prefix"]), ("head_correlations", a["heads"]),
                     ("checkpoints", a["checkpoints"])))
    figs: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    if figures:
        from qkgeom.analysis.e4.figures import degenerate_figures, make_e4_figures

        skipped = degenerate_figures(a["metrics"], a["prefix"])
        figs = make_e4_figures(a["metrics"], a["trends"], a["prefix"], a["heads"], band, out,
                               a["checkpoints"])
    meta = a["meta"]
    parts = [
        f"# E4: token-level Q/K geometry across checkpoints — {md_text(meta['model'])}",
        summary_markdown(claims),
        "## Claims",
        claims_markdown(claims, E4_CLAIM_CELLS),
        _rules_text(boot),
        "## Setup", _setup(meta, a["checkpoints"]),
        "## Contrast regime per layer", _trend_md(a["trends"], boot, a["checkpoints"]) if len(a["trends"]) else "n/a",
        "## pr_qk ↔ attention entropy across heads, per checkpoint",
        "Per layer: Spearman ρ across the layer's heads (the E4.4 statistic); pooled: over all "
        "heads of all layers (mixes depths; shown only).",
        _heads_md(a["heads"], a["checkpoints"]) if len(a["heads"]) else "n/a",
    ]
    if figs or skipped:
        parts.append("## Figures")
        for name, path in figs.items():
            svg = path.with_suffix(".svg").name
            parts.append(f"[![{name}]({path.name})]({path.name})\n\n*{CAPTIONS[name]} "
                         f"Vector version: [{svg}]({svg}).*")
        if skipped:
            parts.append("Not drawn (they would show nothing): " + "; ".join(
                f"`{name}` ({why})" for name, why in skipped.items()) + ".")
    text = "\n\n".join(parts) + "\n"
    return write_pages(out, text, f"qkgeom E4 report: {meta['model']}")
