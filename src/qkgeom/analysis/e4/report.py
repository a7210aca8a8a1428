"""The E4 report of an analysis folder: claims table first, then setup, tables, figures.

``write_e4_report(DIR)`` reads only the folder's JSON/Parquet (no torch, no model) and
writes ``DIR/report/``: ``report.md`` (claims table first), ``report.html`` (figures
embedded), the figures (PNG 300 dpi + SVG) and the numbers as CSV.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.e4.claims import e4_claims
from qkgeom.analysis.e4.trends import head_correlations, prefix_trends, trend_table
from qkgeom.analysis.kit import (
    P_CELL,
    VERDICT_CELL,
    Cell,
    claims_markdown,
    field,
    fmt_p,
    md_code,
    md_table,
    md_text,
    write_csvs,
    write_pages,
)
from qkgeom.errors import QKGeomError
from qkgeom.io import read_json
from qkgeom.runs.family import CHECKPOINT_TABLE, MARKER

__all__ = ["E4_CLAIM_CELLS", "e4_claims_table", "load_analysis", "write_e4_report"]

#: The E4 claims table in Markdown: what each row measured and its own test.
E4_CLAIM_CELLS: tuple[Cell, ...] = (
    ("id", field("claim_id")), ("claim", field("claim")), ("level", field("level")),
    ("measured", field("measured")), ("estimate", field("estimate")), ("test", field("test")),
    P_CELL, VERDICT_CELL)


def load_analysis(folder: str | Path) -> dict:
    """The tables of an analysis folder: ``meta``, ``metrics``, ``checkpoints``; the
    statistics are recomputed from the metrics (duplicates left out unless kept)."""
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
    used = metrics[metrics["in_trends"]]
    return {"meta": meta, "metrics": metrics, "checkpoints": ckpts, "trends": trend_table(used),
            "prefix": prefix_trends(used), "heads": head_correlations(used)}


def e4_claims_table(folder: str | Path) -> pd.DataFrame:
    """The E4 claims of an analysis folder (see :mod:`qkgeom.analysis.e4.claims`)."""
    a = load_analysis(folder)
    return e4_claims(a["trends"], a["heads"])


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
                      [[md_text(r.checkpoint), int(r.step), md_text(r.qk_hash[:12]),
                        md_text(r.duplicate_of or ""), "yes" if r.in_trends else "no",
                        f"{r.tokens_per_s:,.0f}"]
                       for r in ckpts.sort_values("step").itertuples()])
    return "\n".join(lines) + "\n\n" + table


def _trend_md(trends: pd.DataFrame) -> str:
    rows = []
    for r in trends.sort_values(["level", "layer"], ascending=[False, True]).itertuples():
        rows.append([r.level, r.layer, r.n, _f(r.first), _f(r.last), _f(r.rho, "{:+.2f}"),
                     _f(r.mk_z, "{:+.2f}"), fmt_p(r.mk_p_increase),
                     f"{r.regime_len} (→ step {int(r.regime_end_step)})" if r.has_regime else "none",
                     _f(r.suffix_change) if r.suffix_n else "n/a",
                     "yes" if r.decays else "no"])
    return md_table(["level", "layer", "n", "contrast first", "contrast last", "ρ(step)",
                      "MK Z", "p increase", "early regime (checkpoints)", "change after",
                      "decays"], rows)


def _heads_md(heads: pd.DataFrame) -> str:
    pooled = heads[heads["layer"] == -1]
    wide = pooled.pivot_table(index=["step", "checkpoint"], columns="level", values="rho")
    rows = [[md_text(ck), int(st), *(_f(wide.loc[(st, ck)].get(lv, np.nan), "{:+.2f}")
                            for lv in ("token", "weight"))] for st, ck in wide.index]
    return md_table(["checkpoint", "step", "ρ token level", "ρ weight level"], rows)


def write_e4_report(analysis_dir: str | Path, out: str | Path | None = None,
                    figures: bool = True) -> Path:
    """Write the E4 report of an analysis folder; returns the path of ``report.md``."""
    folder = Path(analysis_dir)
    a = load_analysis(folder)
    out = folder / "report" if out is None else Path(out)
    out.mkdir(parents=True, exist_ok=True)
    claims = e4_claims(a["trends"], a["heads"])
    write_csvs(out, (("claims", claims), ("trends", a["trends"]),
                     ("prefix_trends", a["prefix"]), ("head_correlations", a["heads"]),
                     ("checkpoints", a["checkpoints"])))
    figs = {}
    if figures:
        from qkgeom.analysis.e4.figures import make_e4_figures

        figs = make_e4_figures(a["metrics"], a["trends"], a["prefix"], a["heads"], out)
    meta = a["meta"]
    parts = [
        f"# E4: token-level Q/K geometry across checkpoints — {md_text(meta['model'])}",
        "## Claims",
        claims_markdown(claims, E4_CLAIM_CELLS),
        f"Verdicts are computed (`qkgeom.analysis.stats.verdict`: supported = predicted outcome in "
        f"≥ {stats.SUPPORT_SHARE:.0%} of units and sign-test p < {stats.ALPHA}; not supported "
        f"≤ {stats.FAIL_SHARE:.0%}; mixed otherwise). E4.1 is a claim that the trend is *not* "
        "universal: supported when at least one layer lacks a significant whole-run increase. "
        "Layers of one model are not independent; read p with that in mind. Definitions: "
        "`docs/checkpoints.md`.",
        "## Setup", _setup(meta, a["checkpoints"]),
        "## Contrast trend per layer", _trend_md(a["trends"]) if len(a["trends"]) else "n/a",
        "## pr_qk ↔ attention entropy across heads, per checkpoint",
        _heads_md(a["heads"]) if len(a["heads"]) else "n/a",
    ]
    captions = {"contrast_steps": "PR_Q − PR_K per layer against step (hollow: duplicate "
                                  "checkpoints, left out of statistics).",
                "prefix_trend": "Mann–Kendall Z of the first k checkpoints against the k-th "
                                "step; dashed: one-sided p = 0.05; dotted: end of each layer's "
                                "early regime.",
                "qk_entropy_heads": "Every head at each checkpoint: pr_qk (token level) against "
                                    "attention entropy, coloured by layer."}
    if figs:
        parts.append("## Figures")
        for name, path in figs.items():
            parts.append(f"![{name}]({path.name})\n\n{captions[name]}")
    text = "\n\n".join(parts) + "\n"
    return write_pages(out, text, f"qkgeom E4 report: {meta['model']}")
