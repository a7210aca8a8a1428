"""The E4 report of an analysis folder (one model) or of a set of them (one per seed):
the summary line and the claims table first, then setup, tables, figures; files and
layout: docs/report.md (E4). Reads only the folders' JSON/Parquet (no torch, no model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.e4.bootstrap import N_BOOT, block_bootstrap
from qkgeom.analysis.e4.claims import e4_claims, seed_claims
from qkgeom.analysis.e4.labels import UNKNOWN_STEP, names_by_position
from qkgeom.analysis.e4.regime import CALLS, MIN_POINTS, N_SURROGATES, RISE_FALL
from qkgeom.analysis.e4.trends import (
    PRIMARY,
    TREND_METRICS,
    Drift,
    drift_over_seeds,
    head_correlations,
    prefix_trends,
    trend_table,
)
from qkgeom.analysis.kit import (
    MIN_UNITS,
    P_CELL,
    ROLE_CELL,
    VERDICT_CELL,
    Cell,
    Drawn,
    claims_markdown,
    figure_markdown,
    fmt_p,
    md_code,
    md_table,
    md_text,
    show,
    summary_markdown,
    write_csvs,
    write_pages,
)
from qkgeom.errors import QKGeomError
from qkgeom.io import read_json
from qkgeom.runs.family import CHECKPOINT_TABLE, MARKER, SET_MARKER, e4_set_units, is_e4_set

__all__ = ["E4_CLAIM_CELLS", "bootstrap", "e4_claims_table", "load_analysis", "load_set",
           "write_e4_report", "write_e4_set_report"]

#: The E4 claims table in Markdown: what each row measured and its own test.
E4_CLAIM_CELLS: tuple[Cell, ...] = (
    ("level", show("level")), ROLE_CELL, ("measured", show("measured")),
    ("estimate", show("estimate")), ("test", show("test")), P_CELL,
    ("beside", show("beside")), VERDICT_CELL)
#: Figure captions of the report.
CAPTIONS = {
    "contrast_steps": "PR_Q − PR_K per layer against step (hollow: duplicate checkpoints, "
                      "left out of statistics); primary contrast with its 95 % token-block "
                      "bootstrap band; ◆ the peak after the warm-up (shaded: the LR warm-up, "
                      "not in the regime rule); △ the warm-up's largest checkpoint where it "
                      "lies above the rule's first (an early peak, not tested).",
    "e4_seeds": "The primary contrast per layer, one line per seed; shaded: the LR warm-up "
                "(not in the regime rule); ◆ the peak of a layer called rise then fall, ○ "
                "the peak of the others; △ a peak inside the warm-up above the rule's first "
                "checkpoint (not tested).",
    "prefix_trend": "Descriptive: Mann–Kendall Z of the first k checkpoints against the k-th "
                    "step; dashed: one-sided p = 0.05; dotted: each layer's peak when it has "
                    "a regime.",
    "qk_entropy_heads": "Every head at each checkpoint: pr_qk (token level) against attention "
                        "entropy, coloured by layer.",
}


def load_analysis(folder: str | Path, drift: Drift | None = None) -> dict:
    """The tables of an analysis folder: ``meta``, ``metrics`` (measured on all tokens:
    ``block`` −1, or every row of a folder without blocks), ``blocks`` (the per-block rows,
    maybe empty), ``checkpoints``; the statistics ``trends``, ``prefix``, ``heads`` are
    recomputed from the metrics (duplicates left out unless kept), the regime calls with
    the random walk of ``drift`` (a set's, from its seeds; None for one model), kept as
    ``drift``. The block bootstrap is not run here (:func:`bootstrap`)."""
    a = _read_analysis(Path(folder))
    used = a["metrics"][a["metrics"]["in_trends"]]
    return {**a, "drift": drift, "trends": trend_table(used, a["used_blocks"], a["warmup"],
                                                       drift=drift),
            "prefix": prefix_trends(used), "heads": head_correlations(used)}


def _read_analysis(folder: Path) -> dict:
    """The tables of an analysis folder as read (:func:`load_analysis`), no statistics;
    ``used_blocks``: the per-block rows in the trends."""
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
    used_blocks = blocks[blocks["in_trends"]] if len(blocks) else blocks
    warmup = meta.get("warmup_steps")
    warmup = int(warmup) if isinstance(warmup, (int, float)) and warmup >= 0 else None
    return {"meta": meta, "metrics": metrics, "blocks": blocks, "checkpoints": ckpts,
            "warmup": warmup, "used_blocks": used_blocks}


def bootstrap(analysis: dict, n_boot: int = N_BOOT) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The token-block bootstrap of the primary contrast of :func:`load_analysis`'s
    tables, on the checkpoints in the trends: ``(per layer, band)`` (empty without
    blocks)."""
    blocks, used = analysis["blocks"], analysis["metrics"]
    if blocks.empty or used.empty:
        return pd.DataFrame(), pd.DataFrame()
    return block_bootstrap(used[used["in_trends"]], blocks[blocks["in_trends"]],
                           analysis["warmup"], PRIMARY, n_boot, drift=analysis.get("drift"))


def e4_claims_table(folder: str | Path, n_boot: int = N_BOOT) -> pd.DataFrame:
    """The E4 claims of an analysis folder or a set of them, one per seed (see
    :mod:`qkgeom.analysis.e4.claims`)."""
    if is_e4_set(folder):
        return seed_claims({u: (a["trends"], a["heads"]) for u, a in load_set(folder).items()})
    a = load_analysis(folder)
    return e4_claims(a["trends"], a["heads"], bootstrap(a, n_boot)[0])


def load_set(folder: str | Path) -> dict[str, dict]:
    """``{seed label: load_analysis(its folder)}`` of an E4 set (``e4.json``), every seed's
    regime calls with the random walk estimated across the seeds
    (:func:`~qkgeom.analysis.e4.trends.drift_over_seeds`)."""
    paths = e4_set_units(folder)
    raw = [_read_analysis(Path(p)) for p in paths.values()]
    drift = drift_over_seeds([(a["metrics"][a["metrics"]["in_trends"]], a["used_blocks"],
                               a["warmup"]) for a in raw])
    return {label: load_analysis(path, drift) for label, path in paths.items()}


def _step_cell(step: float, source: str) -> str:
    """A checkpoint's step for a table: "—" when only its position is known (step_source
    ``order``: a pretrained model, a folder without a step), never a made-up "0"."""
    return "—" if source == UNKNOWN_STEP else str(int(step))


def _at(step: float, names: dict[float, str] | None) -> str:
    """Where a trend peaks: its step, or the checkpoint's name when no step is known."""
    return md_text(names.get(float(step), int(step))) if names else str(int(step))


def _f(x: float, fmt: str = "{:+.3f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and np.isfinite(x) else "n/a"


def _warmup_line(warmup: int | None, ckpts: pd.DataFrame) -> str:
    used = ckpts[ckpts["in_trends"]] if "in_trends" in ckpts else ckpts
    if warmup is None:
        return ("- **LR warm-up**: not recorded for this family (not a qkgeom run): every "
                f"checkpoint in the trends ({len(used)}) is in the regime rule")
    inside = int((used["step"] < warmup).sum())
    return (f"- **LR warm-up**: ends at step {warmup}; the regime rule reads the "
            f"{len(used) - inside} checkpoints at or after it, the {inside} inside it are "
            "shown, not tested")


def _setup(meta: dict, ckpts: pd.DataFrame, warmup: int | None = None) -> str:
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
        _warmup_line(warmup, ckpts),
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
                       "in the regime rule", "tokens/s"],
                      [[md_text(r.checkpoint), _step_cell(r.step, r.step_source),
                        md_text(r.qk_hash[:12]),
                        md_text(r.duplicate_of or ""), "yes" if r.in_trends else "no",
                        "yes" if r.in_trends and (warmup is None or r.step >= warmup)
                        else "no (warm-up)" if r.in_trends else "no",
                        f"{r.tokens_per_s:,.0f}"]
                       for r in ckpts.sort_values("step").itertuples()])
    return "\n".join(lines) + "\n\n" + table


def _boot_cells(r: Any, boot: pd.DataFrame, names: dict[float, str] | None
                ) -> tuple[str, str, str]:
    """(peak @ step [interval], share lost [interval], share of resamples with this call)."""
    peak, lost = _at(r.peak_step, names), _f(r.share_lost, "{:.2f}")
    b = boot[boot["layer"] == r.layer] if len(boot) and r.metric == PRIMARY else boot.iloc[0:0]
    if not len(b):
        return peak, lost, "n/a"
    b = b.iloc[0]
    if np.isfinite(r.share_lost):
        lost += f" [{_f(b['share_lost_low'], '{:.2f}')}, {_f(b['share_lost_high'], '{:.2f}')}]"
    if np.isfinite(b["peak_step_low"]):
        peak += f" [{_at(b['peak_step_low'], names)}, {_at(b['peak_step_high'], names)}]"
    same = b[f"share_{r.call.replace(' ', '_')}"]
    return peak, lost, f"{same:.0%}" if np.isfinite(same) else "n/a"


_TREND_HEADER = ["n (warm-up)", "contrast first", "peak @ step [95 % bootstrap]", "last",
                 "call", "p rise", "p fall", "share of gain lost [95 % bootstrap]",
                 "noise sd: tokens, jitter, walk step", "resamples with this call",
                 "warm-up peak above the first (not tested)"]


def _warmup_cell(r: Any, names: dict[float, str] | None) -> str:
    """The warm-up's largest checkpoint where it lies above the rule's first: its step,
    the excess and the excess in noise sd's (descriptive); "—" otherwise."""
    excess = getattr(r, "warmup_excess", np.nan)
    if not (np.isfinite(excess) and excess > 0):
        return "—"
    z = getattr(r, "warmup_excess_z", np.nan)
    sd = f" ({z:.1f} sd)" if np.isfinite(z) else ""
    return f"{_at(r.warmup_peak_step, names)}: {_f(excess)}{sd}"


def _trend_cells(r: Any, boot: pd.DataFrame, names: dict[float, str] | None) -> list[str]:
    peak, lost, same = _boot_cells(r, boot, names)
    called = np.isfinite(r.p_fall)
    walk = _f(getattr(r, "drift_sd", np.nan), "{:.3f}")
    return [f"{r.n} ({r.n_warmup})", _f(r.first), f"{_f(r.peak)} @ {peak}", _f(r.last),
            f"**{r.call}**" if called else f"{r.call} (too few checkpoints)",
            fmt_p(r.p_rise), fmt_p(r.p_fall), lost,
            f"{_f(r.token_sd, '{:.3f}')}, {_f(r.jitter_sd, '{:.3f}')}, {walk}", same,
            _warmup_cell(r, names)]


def _trend_md(trends: pd.DataFrame, boot: pd.DataFrame, ckpts: pd.DataFrame) -> str:
    names = names_by_position(ckpts)
    order = {lv: i for i, lv in enumerate(TREND_METRICS.values())}
    trends = trends.assign(_o=trends["level"].map(order)).sort_values(["_o", "layer"])
    rows = [[r.level, r.layer, *_trend_cells(r, boot, names)] for r in trends.itertuples()]
    return md_table(["level", "layer", *_TREND_HEADER], rows)


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


_CALL_RULE = (
    "Regime call per layer, on the checkpoints after the LR warm-up (those inside it are "
    "shown, not tested): the **gain** (peak − first) and the **drop** (peak − last), each "
    "divided by the series' noise (its robust second-difference sd), are compared with "
    f"{N_SURROGATES} surrogates of a *constant* curve plus the measured noise (token-block "
    "deviations and checkpoint jitter), the peak taken in each surrogate as in the data. A "
    "constant curve gives the largest drop any monotone curve can give with the same noise, "
    "so a drop beyond it is one no monotone curve explains. *rise then fall* = both "
    f"significant (p < {stats.ALPHA}); *monotone rise* = the gain only (a rise that levels "
    "off is a monotone rise, never a regime); *fall* = the drop only; *no trend* = neither; "
    f"a layer with fewer than {MIN_POINTS} checkpoints after the warm-up gets no call. Share "
    "of the gain lost = drop / gain, only where the rise is significant. Over seeds the "
    "surrogates also hold a random walk within each run (one step per checkpoint), its "
    "step variance estimated from the seeds' deviations from their mean curve (the walk "
    "step sd in the tables; one model: none). A largest checkpoint inside the warm-up above "
    "the rule's first is shown beside each call (△ in the figures): an early peak the rule "
    "does not test, which reads there as a fall or no trend.")


def _boot_line(boot: pd.DataFrame) -> str:
    return (f"The token-block bootstrap ({int(boot['n_boot'].iloc[0])} resamples of the "
            f"{int(boot['n_blocks'].iloc[0])} token blocks, fixed seed) moves the all-token "
            "trajectory by the mean deviation of the drawn blocks and recomputes each layer's "
            "call against the same null; it shows how much a call depends on which tokens "
            "were read, and is descriptive (blocks of one text are not independent samples "
            "of the model's behaviour)." if len(boot) else
            "No token blocks are recorded in this folder (`qkgeom analyze --blocks K`): the "
            "noise is the checkpoint jitter alone, and there is no bootstrap of the calls.")


def _rules_text(boot: pd.DataFrame) -> str:
    return (
        "**Unit: one model. Its layers are not independent**, so counts and p-values over "
        "layers describe rather than infer. E4.1 (some layer falls) and E4.2 (some layer "
        "rises then falls) are decided by the model's own p: the smallest layer p, "
        f"Šidák-adjusted over its layers (supported when < {stats.ALPHA}, inconclusive "
        "otherwise); E4.3 and E4.4 by the verdict rule over layers "
        f"(`qkgeom.analysis.stats.verdict`: supported = p < {stats.ALPHA} in the predicted "
        f"direction with ≥ {stats.SUPPORT_SHARE:.0%} of layers, mixed = significant with "
        "fewer, not supported = the opposite direction significant (E4.4 only: the E4.3 "
        "score joins two tests and is negative without the effect), inconclusive "
        "otherwise). The primary row of each claim decides it (primary contrast for "
        "E4.1–E4.3, token level for E4.4); the other rows are secondary, their p's "
        "Holm-adjusted together. A verdict over seeds needs a set of runs (`qkgeom "
        "reproduce e4`). "
        f"Primary contrast: `{PRIMARY}` (the mean over query heads of PR_Q^h − PR_K^g(h), "
        "fair under grouped-query attention); the other contrasts are shown beside. "
        f"{_CALL_RULE} {_boot_line(boot)} Protocol: `docs/protocols.md`; definitions: "
        "`docs/checkpoints.md`.")


def write_e4_report(analysis_dir: str | Path, out: str | Path | None = None,
                    figures: bool = True, n_boot: int = N_BOOT) -> Path:
    """Write the E4 report of an analysis folder, or of a set of them (one per seed,
    ``e4.json``: :func:`write_e4_set_report`); returns the path of ``report.md``."""
    folder = Path(analysis_dir)
    if is_e4_set(folder):
        return write_e4_set_report(folder, out, figures, n_boot)
    a = load_analysis(folder)
    out = folder / "report" if out is None else Path(out)
    out.mkdir(parents=True, exist_ok=True)
    boot, band = bootstrap(a, n_boot)
    claims = e4_claims(a["trends"], a["heads"], boot)
    write_csvs(out, (("claims", claims), ("trends", a["trends"]), ("bootstrap", boot),
                     ("prefix_trends", a["prefix"]), ("head_correlations", a["heads"]),
                     ("checkpoints", a["checkpoints"])))
    figs = Drawn()
    if figures:
        from qkgeom.analysis.e4.figures import make_e4_figures  # matplotlib: only to draw

        figs = make_e4_figures(a, band, out)
    meta = a["meta"]
    parts = [
        f"# E4: token-level Q/K geometry across checkpoints — {md_text(meta['model'])}",
        summary_markdown(claims),
        "## Claims",
        claims_markdown(claims, E4_CLAIM_CELLS),
        _rules_text(boot),
        "## Setup", _setup(meta, a["checkpoints"], a["warmup"]),
        "## Contrast regime per layer",
        _trend_md(a["trends"], boot, a["checkpoints"]) if len(a["trends"]) else "n/a",
        "## pr_qk ↔ attention entropy across heads, per checkpoint",
        "Per layer: Spearman ρ across the layer's heads (the E4.4 statistic); pooled: over all "
        "heads of all layers (mixes depths; shown only).",
        _heads_md(a["heads"], a["checkpoints"]) if len(a["heads"]) else "n/a",
    ]
    text = "\n\n".join(parts + _figure_parts(figs)) + "\n"
    return write_pages(out, text, f"qkgeom E4 report: {meta['model']}")


def _figure_parts(figs: Drawn) -> list[str]:
    if not figs.pngs and not figs.empty:
        return []
    parts = ["## Figures"]
    parts += ["\n".join(figure_markdown(png, CAPTIONS[name])) for name, png in figs.pngs.items()]
    if figs.empty:
        parts.append("Not drawn (they would show nothing): " + "; ".join(
            f"`{name}` ({why})" for name, why in figs.empty.items()) + ".")
    return parts


# ------------------------------------------------------------------ a set: seed as the unit


def _with_unit(frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The frames of every seed stacked, led by a ``unit`` column."""
    parts = [f.assign(unit=u) for u, f in frames.items() if len(f)]
    if not parts:
        return pd.DataFrame()
    out = pd.concat(parts, ignore_index=True)
    return out[["unit", *(c for c in out.columns if c != "unit")]]


def _set_rules(n: int) -> str:
    few = (f" With {n} seeds no claim can be supported (the sign-flip p is at least "
           f"1/2^{n} ≥ {stats.ALPHA})." if n < MIN_UNITS else "")
    return (
        "**Unit: the seed.** The layers of one model share its data, optimiser and every "
        "update, so they are not independent: each seed's layers are summarised into one "
        "value per claim, then the exact sign-flip test over seeds and the verdict rule "
        f"(`qkgeom.analysis.stats.verdict`: supported = p < {stats.ALPHA} with ≥ "
        f"{stats.SUPPORT_SHARE:.0%} of seeds with a score > 0, mixed = significant with "
        "fewer, not supported = the opposite direction significant (E4.1 and E4.4 only: "
        "the E4.2 and E4.3 scores join two tests, rise and fall, and are negative without "
        "the effect, so their opposite direction says nothing), inconclusive "
        "otherwise). The primary row of each claim (primary contrast for E4.1–E4.3, token "
        "level for E4.4) decides it at α; the other rows are secondary, their p's "
        f"Holm-adjusted together.{few} Per seed: E4.1 the probit Φ⁻¹(1 − p) of the "
        "seed's smallest layer p of a fall, Šidák-adjusted over its layers (some layer "
        "falls); E4.2 the same for a rise then fall (both p's); E4.3 the mean over layers "
        "of min(z_rise, z_fall) (the typical layer rises and falls back); E4.4 the mean "
        "over layers of ρ(pr_qk, entropy) across heads at the last checkpoint. The E4.1 "
        "score is about N(0, 1) at a constant curve, the E4.2 and E4.3 scores below it. "
        f"Primary contrast: `{PRIMARY}`. "
        f"{_CALL_RULE} Protocol: `docs/protocols.md`.")


def _set_setup(meta: dict, units: dict[str, dict]) -> str:
    first = next(iter(units.values()))
    ck = first["checkpoints"]
    warmup = first["warmup"]
    lines = [f"- **set**: {md_text(meta.get('name', 'E4'))}, preset "
             f"{md_code(meta.get('preset', '?'))}, {len(units)} seeds: "
             + ", ".join(md_code(u) for u in units),
             f"- **runs** (one model per seed: {md_text(ck.iloc[0]['arch'])}, "
             f"{int(ck.iloc[0]['n_head'])} heads per layer): "
             + ", ".join(md_code(a["meta"]["model"]) for a in units.values()),
             f"- **text**: {md_code(first['meta']['settings']['text'])}, first "
             f"{first['meta']['settings']['max_tokens']:,} tokens, "
             f"{int(ck.iloc[0]['blocks'])} token blocks",
             f"- **checkpoints per seed**: {len(ck)} at steps "
             + ", ".join(str(int(s)) for s in sorted(ck["step"])),
             _warmup_line(warmup, ck)]
    for u, a in units.items():
        dups = a["checkpoints"]["duplicate_of"].notna().sum()
        if dups:
            lines.append(f"- {md_code(u)}: {int(dups)} duplicate checkpoint(s) left out")
    return "\n".join(lines)


def _set_trend_md(units: dict[str, dict], boots: dict[str, pd.DataFrame]) -> str:
    rows = []
    for u, a in units.items():
        t = a["trends"]
        t = t[t["metric"] == PRIMARY] if len(t) else t
        for r in t.sort_values("layer").itertuples():
            rows.append([md_code(u), r.layer, *_trend_cells(r, boots[u], None)])
    return md_table(["seed", "layer", *_TREND_HEADER], rows)


def _set_count_md(units: dict[str, dict]) -> str:
    t = _with_unit({u: a["trends"] for u, a in units.items()})
    if t.empty:
        return "n/a"
    t = t[(t["metric"] == PRIMARY) & t["p_fall"].notna()]
    rows = []
    for layer, g in t.groupby("layer"):
        counts = g["call"].value_counts()
        lost = g.loc[g["call"] == RISE_FALL, "share_lost"].dropna()
        rows.append([layer, *[int(counts.get(c, 0)) for c in CALLS],
                     _f(lost.mean(), "{:.2f}") if len(lost) else "n/a"])
    return md_table(["layer", *CALLS, "mean share of gain lost (rise then fall)"], rows)


def write_e4_set_report(folder: str | Path, out: str | Path | None = None,
                        figures: bool = True, n_boot: int = N_BOOT) -> Path:
    """The report over seeds of an E4 set (``e4.json``: one analysis folder per seed):
    claims with the seed as the unit, the calls per seed and layer, the figure of every
    seed's primary contrast; returns the path of ``report.md``."""
    folder = Path(folder)
    meta = read_json(folder / SET_MARKER)
    units = load_set(folder)
    out = folder / "report" if out is None else Path(out)
    out.mkdir(parents=True, exist_ok=True)
    boots = {u: bootstrap(a, n_boot)[0] for u, a in units.items()}
    claims = seed_claims({u: (a["trends"], a["heads"]) for u, a in units.items()})
    write_csvs(out, (("claims", claims),
                     ("trends", _with_unit({u: a["trends"] for u, a in units.items()})),
                     ("bootstrap", _with_unit(boots)),
                     ("head_correlations", _with_unit({u: a["heads"] for u, a in units.items()})),
                     ("checkpoints", _with_unit({u: a["checkpoints"]
                                                 for u, a in units.items()}))))
    figs = Drawn()
    if figures:
        from qkgeom.analysis.e4.figures import make_e4_set_figure

        figs = make_e4_set_figure({u: (a["metrics"], a["trends"]) for u, a in units.items()},
                                  next(iter(units.values()))["warmup"], out)
    paths = e4_set_units(folder)
    reports = [f"{md_code(u)}: {md_code((paths[u] / 'report' / 'report.md').relative_to(folder))}"
               for u in units if (paths[u] / "report" / "report.md").is_file()]
    parts = [
        f"# E4 over seeds: token-level Q/K geometry across checkpoints — "
        f"{md_text(meta.get('name', folder.name))}",
        summary_markdown(claims),
        "## Claims",
        claims_markdown(claims, E4_CLAIM_CELLS),
        _set_rules(len(units)),
        "## Setup", _set_setup(meta, units),
        f"## Calls per layer over seeds ({PRIMARY})", _set_count_md(units),
        f"## Regime call per seed and layer ({PRIMARY})", _set_trend_md(units, boots),
        "Each seed's own report (every contrast, the across-head table, its figures; "
        "`qkgeom report` on its analysis folder writes it): "
        + ("; ".join(reports) if reports else "none written yet") + ".",
    ]
    text = "\n\n".join(parts + _figure_parts(figs)) + "\n"
    return write_pages(out, text, f"qkgeom E4 report over seeds: {meta.get('name', '')}")
