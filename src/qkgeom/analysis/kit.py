"""The one kit every report shares (E1/E2, E3, E4, one run folder): its text and its page.

Every value read from a file enters a report through :func:`md_text` or :func:`md_code`:
names, run ids and error texts are data, never Markdown or HTML. Needs pandas only (and
``markdown`` for the page); the figure style is ``figstyle``.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.collate import MONITOR_SOURCE, Collated, is_single_run, sweep_axes
from qkgeom.analysis.stats import ALPHA, SUPPORTED, VERDICTS
from qkgeom.io import atomic_write

# ---------------------------------------------------------------------------------------
# Markdown and numbers
# ---------------------------------------------------------------------------------------


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table; ``|`` and newlines inside cells are escaped. (Not
    ``DataFrame.to_markdown``: it needs tabulate, which pads cells and leaves ``|`` as is.)"""
    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


_MD_SPECIAL = re.compile(r"([\\`*_\[\]#!])")


def md_text(value: Any) -> str:
    """``value`` as literal Markdown text on one line: Markdown syntax backslash-escaped,
    ``&<>`` as entities, so neither Markdown nor HTML in it does anything (``|`` is
    :func:`md_table`'s: a one-line value cannot start a table)."""
    text = " ".join(str(value).split())
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", text)


def md_code(value: Any) -> str:
    """``value`` as an inline code span on one line, whatever backticks it holds."""
    text = " ".join(str(value).split())
    ticks = "`" * (max((len(r) for r in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def fmt_p(p: float) -> str:
    """A p-value: 3 decimals, 2 significant digits below 0.001, ``n/a`` when not finite."""
    if not np.isfinite(p):
        return "n/a"
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}"


#: Below this magnitude an estimate is printed as 0: what is left is rounding noise of
#: float sums (a mean of ρ = ±1 over heads, a difference of equal PRs), not a measurement.
ZERO_BELOW = 1e-6


def signed(x: float, digits: int = 3) -> str:
    """A signed number: ``digits`` decimals (significant digits below 0.01), ``0.000``
    below :data:`ZERO_BELOW`, ``n/a`` when not finite."""
    if not np.isfinite(x):
        return "n/a"
    if abs(x) < ZERO_BELOW:
        return f"{0.0:.{digits}f}"
    return f"{x:+.{digits}g}" if abs(x) < 1e-2 else f"{x:+.{digits}f}"


def with_ci(mean: float, lo: float, hi: float) -> str:
    """``+0.123 [+0.100, +0.146]`` (:func:`signed`; no bracket without an interval)."""
    return signed(mean) + (f" [{signed(lo)}, {signed(hi)}]" if np.isfinite(lo) else "")


# ---------------------------------------------------------------------------------------
# The claims table
# ---------------------------------------------------------------------------------------

#: ``claims.csv`` of E1/E2 and E3 (column meanings: docs/report.md#claims): ``k`` of
#: ``n`` independent units with the predicted sign, the t-interval, the sign-flip p's both
#: ways and the sign test, the equivalence test within ±``delta``, the Holm-adjusted p's of
#: the row's ``family``, the verdict and, when not evaluated, the ``reason``.
CLAIM_COLUMNS = ["claim_id", "claim", "role", "level", "origin", "from", "criterion", "unit",
                 "k", "n", "share", "measured", "mean", "ci_low", "ci_high", "estimate",
                 "test", "p_value", "p_opposite", "p_sign", "delta", "p_equiv", "detectable",
                 "p_adj", "p_opposite_adj", "p_equiv_adj", "family", "beside", "verdict",
                 "reason"]
#: The numbers of a claims row that come from its units' test (:func:`stats.unit_test`).
_UNIT_NUMBERS = ("share", "mean", "ci_low", "ci_high", "p_value", "p_opposite", "p_sign",
                 "p_equiv", "detectable")


def claim_row(claim_id: str, claim: str, level: str, u: dict[str, Any], *, role: str,
              unit: str, measured: str, estimate: str, test: str, beside: str,
              reason: str = "", delta: float = float("nan"), universal_ok: bool | None = None,
              **extra: Any) -> dict[str, Any]:
    """One row of any experiment's claims table from ``u`` (:func:`stats.unit_test`'s,
    NaN for the numbers it lacks); ``universal_ok`` for a claim about all units, ``extra``
    the experiment's own columns. :func:`decide` adds the adjusted p's and the verdict."""
    nan = float("nan")
    return {"claim_id": claim_id, "claim": claim, "role": role, "level": level, "unit": unit,
            "measured": measured, "k": u["k"], "n": u["n"],
            **{key: u.get(key, nan) for key in _UNIT_NUMBERS}, "estimate": estimate,
            "test": test, "beside": beside, "reason": reason, "delta": delta,
            "universal_ok": universal_ok, **extra}


def reasons(claims: pd.DataFrame) -> pd.Series:
    """Each row's ``reason``, "" where it has none (read back from CSV it may be NaN)."""
    return claims["reason"].astype(object).fillna("").astype(str)


def decide(claims: pd.DataFrame, *, holm_primary: bool) -> pd.DataFrame:
    """The adjusted p's and the verdict of :func:`claim_row` rows.

    Two Holm families by ``role``: the primary rows (each at α unless ``holm_primary``,
    E1/E2's one family) and the secondary rows; a row not evaluated (a ``reason``, or no
    unit) is in none. The verdict: :func:`qkgeom.analysis.stats.verdict`."""
    out = claims.copy()
    reason = out["reason"] = reasons(out)
    for col in ("p_adj", "p_opposite_adj", "p_equiv_adj"):
        out[col] = np.nan
    out["family"] = 0
    for role, adjust in (("primary", holm_primary), ("secondary", True)):
        rows = out.index[(out["role"] == role) & (reason == "") & (out["n"] > 0)]
        out.loc[rows, "family"] = len(rows)
        for col in ("p_value", "p_opposite", "p_equiv"):
            values = out.loc[rows, col].to_numpy(dtype=float)
            adj = "p_adj" if col == "p_value" else f"{col}_adj"
            out.loc[rows, adj] = stats.holm(values) if adjust else values
    out["verdict"] = [
        stats.verdict(int(r.k), int(r.n), r.p_adj, p_opposite=r.p_opposite_adj,
                      p_equiv=r.p_equiv_adj, reason=r.reason,
                      universal_ok=None if pd.isna(r.universal_ok) else bool(r.universal_ok))
        for r in out.itertuples()]
    return out


#: A column of a claims table in Markdown: (header, cell of one claims record).
Cell = tuple[str, Callable[[dict[str, Any]], Any]]


def show(key: str) -> Callable[[dict[str, Any]], Any]:
    """The cell that shows the record's ``key`` as it is."""
    return lambda r: r[key]


def _reason(r: dict[str, Any]) -> str:
    reason = r.get("reason")
    return reason if isinstance(reason, str) else ""


#: The row's one p: the one its verdict reads (Holm-adjusted within its family; a family
#: tested each at α keeps the raw p). The raw p and the sign test's are in claims.csv.
P_CELL: Cell = ("p (adjusted)", lambda r: fmt_p(r["p_adj"]))
#: Which rows decide the claim: **primary** in bold, secondary rows are descriptive.
ROLE_CELL: Cell = ("row", lambda r: "**primary**" if r.get("role") == "primary"
                   else str(r.get("role") or ""))
#: The verdict in bold, with the reason when there is one (*not evaluated*).
VERDICT_CELL: Cell = ("verdict", lambda r: f"**{r['verdict']}**" + (
    f" ({_reason(r)})" if _reason(r) else ""))
NOTE_CELL: Cell = ("note", _reason)
#: The E1/E2 and E3 layout under each claim's group row.
SWEEP_CLAIM_CELLS: tuple[Cell, ...] = (
    ("level", show("level")), ROLE_CELL, ("measured from", show("from")),
    ("units with the sign (k/n)", show("measured")),
    ("estimate [95 % t-interval]", show("estimate")), P_CELL,
    ("beside", show("beside")), VERDICT_CELL)

#: Units a claims table may decide verdicts over: independent runs (E1/E2) or seeds (E3).
#: E4's unit, a layer of one model, is not independent; its report says so itself.
INDEPENDENT_UNITS = ("runs", "seeds")
#: Fewer independent units than this give a descriptive report, no verdicts: the smallest
#: exact sign-flip p of n units is 1/2^n, which must fall below α (the verdict rule's).
MIN_UNITS = stats.MIN_UNITS


def _unit_word(n: int, unit: str) -> str:
    return unit[:-1] if n == 1 and unit.endswith("s") else unit


def units_measured(claims: pd.DataFrame) -> tuple[int, str] | None:
    """``(n, unit)``: the most independent units any row measured, and what they are; None
    for a table whose unit is not independent (E4) or that has no rows."""
    if claims.empty or not {"n", "unit"} <= set(claims.columns):
        return None
    units = [str(u) for u in claims["unit"].dropna().unique()]
    if not units or not set(units) <= set(INDEPENDENT_UNITS):
        return None
    n = pd.to_numeric(claims["n"], errors="coerce").max()
    return (int(n) if np.isfinite(n) else 0), units[0]


def descriptive_reason(claims: pd.DataFrame) -> str:
    """The one line that makes a report descriptive ("" when it is not): fewer than
    :data:`MIN_UNITS` independent units, whose sign-flip p never falls below α."""
    measured = units_measured(claims)
    if measured is None or measured[0] >= MIN_UNITS:
        return ""
    n, unit = measured
    floor = (f"the exact sign-flip p of {n} {_unit_word(n, unit)} is at least "
             f"1/2^{n} = {0.5 ** n:.3g}" if n else f"no {_unit_word(2, unit)} measured")
    return (f"Descriptive: {n} {_unit_word(n, unit)}. A verdict needs at least {MIN_UNITS} "
            f"{unit} ({floor}, never below {ALPHA}), so its claims table shows what was "
            "measured, with no verdict.")


def claim_groups(claims: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """``(claim_id, claim, rows)`` per claim (id and text: an E3 claim is one per arm), in
    the order claims first appear, each with its rows in table order."""
    if claims.empty:
        return []
    keys = [claims[c].astype(str).to_numpy() for c in ("claim_id", "claim")]
    return [(cid, text, rows) for (cid, text), rows in claims.groupby(keys, sort=False)]


def claims_markdown(claims: pd.DataFrame, cells: Sequence[Cell] = SWEEP_CLAIM_CELLS) -> str:
    """The claims table as Markdown: per claim a group row (id and text, other cells empty:
    ``report.html`` spans it), then its records in the columns ``cells``. A descriptive
    table (:func:`descriptive_reason`) shows reasons in a ``note`` column, no verdicts."""
    if descriptive_reason(claims):
        has_note = "reason" in claims and bool(reasons(claims).str.len().any())
        cells = [c for c in cells if c[0] != VERDICT_CELL[0]] + ([NOTE_CELL] if has_note else [])
    header = [f"claim / {cells[0][0]}", *(h for h, _ in cells[1:])]
    rows: list[list[Any]] = []
    for claim_id, claim, group in claim_groups(claims):
        rows.append([f"{claim_id} · **{claim}**", *([""] * (len(cells) - 1))])
        rows += [[cell(r) for _, cell in cells] for r in group.to_dict("records")]
    return md_table(header, rows)


def primary_rows(claims: pd.DataFrame) -> pd.DataFrame:
    """The rows that decide the claims (all rows of a table without roles)."""
    return claims[claims["role"] == "primary"] if "role" in claims else claims


def claims_summary(claims: pd.DataFrame) -> str:
    """The line that opens a report: the experiment and the verdicts of its primary rows
    ("E1/E2: 3 of 6 claims supported, 1 mixed, … (primary rows; 16 secondary rows below)"),
    or, for a descriptive table, what was measured."""
    if claims.empty:
        return "No claims could be evaluated."
    families = sorted({str(c).split(".", 1)[0] for c in claims["claim_id"]},
                      key=lambda f: (len(f), f))
    measured = units_measured(claims) if descriptive_reason(claims) else None
    if measured is not None:
        n, unit = measured
        empty = int((pd.to_numeric(claims["n"], errors="coerce").fillna(0) == 0).sum())
        return (f"{'/'.join(families)}: descriptive, {n} {_unit_word(n, unit)} (a verdict "
                f"needs at least {MIN_UNITS}): {len(claims)} claim rows, "
                f"{len(claims) - empty} measured, {empty} not measurable "
                f"({len(claim_groups(claims))} claims)")
    primary = primary_rows(claims)
    counts = primary["verdict"].value_counts() if len(primary) else pd.Series(dtype=int)
    counts = {v: int(counts.get(v, 0)) for v in VERDICTS}
    rest = ", ".join(f"{counts[v]} {v}" for v in VERDICTS[1:] if counts[v])
    secondary = len(claims) - len(primary)
    tail = f" (primary rows; {secondary} secondary rows below)" if secondary else ""
    return (f"{'/'.join(families)}: {counts[SUPPORTED]} of {len(primary)} claims "
            f"{SUPPORTED}{', ' + rest if rest else ''}{tail}")


def summary_markdown(claims: pd.DataFrame) -> str:
    """:func:`claims_summary` as the report's opening line (a banner in ``report.html``)."""
    return f"> **{claims_summary(claims)}**"


# ---------------------------------------------------------------------------------------
# Sections of a sweep or run-folder report
# ---------------------------------------------------------------------------------------


def distinct(values: pd.Series, fmt: str = "{}") -> str:
    """The distinct values, sorted, as Markdown text (``n/a`` for none)."""
    vals = sorted({v for v in values.dropna().tolist()}, key=lambda v: (str(type(v)), v))
    return md_text(", ".join(fmt.format(v) for v in vals)) if vals else "n/a"


def _duration(seconds: float) -> str:
    if not np.isfinite(seconds):
        return "n/a"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _n_params(r: pd.Series) -> int:
    if "n_params" in r and pd.notna(r["n_params"]):  # recorded (a monitored model)
        return int(r["n_params"])
    d, L, bias = int(r["n_embd"]), int(r["depth"]), bool(r.get("bias"))
    per_layer = 12 * d * d + 2 * d + (11 * d if bias else 0)
    return L * per_layer + (int(r["vocab_size"]) + int(r["block_size"])) * d + d * (
        2 if bias else 1)


def _model_line(sizes: pd.DataFrame) -> str:
    def one(r: pd.Series) -> str:
        context = f"context {int(r['block_size'])}" if r["block_size"] else "context n/a"
        if r.get("source") == MONITOR_SOURCE:  # the probe's length, not the model's context
            context = f"probes of {int(r['block_size'])} tokens"
        return (f"depth {int(r['depth'])}: {int(r['n_head'])} heads, d_model "
                f"{int(r['n_embd'])}, {context}, {_n_params(r) / 1e6:.2f} M parameters")
    return "- **Models**: " + "; ".join(one(r) for _, r in sizes.iterrows())


def run_groups(data: Collated) -> tuple[pd.DataFrame, ...]:
    """``(runs, included, trained, monitored)``: every run, those in the numbers, and of
    these the ones qkgeom trained and the ones a GeometryMonitor watched."""
    runs, inc = data.runs, data.included
    monitored = inc[inc["source"] == MONITOR_SOURCE] if "source" in inc else inc.iloc[:0]
    return runs, inc, inc.drop(monitored.index), monitored


def setup_markdown(data: Collated, *, unit_line: str = "", reference_line: str = "") -> str:
    """Grid, data, model sizes, tokens, seeds, probes and time of a sweep or one run
    folder; an experiment adds its ``unit_line`` (after the models) and
    ``reference_line`` (before the probes). Facts a folder does not record (a run whose
    config holds no training config, a monitored run's loop) are left out with a note."""
    runs, inc, trained, monitored = run_groups(data)
    lines = ["## Setup", "", _folder_line(data, runs, inc)]
    axes = sweep_axes(data.sweep)
    if axes:
        grid = data.sweep.get("grid", {})
        preset = f" on preset {md_code(grid['preset'])}" if grid.get("preset") else ""
        lines.append(f"- **Grid** (sweep.json){preset}: " + "; ".join(
            f"{md_code(k)} ∈ {{{md_text(', '.join(map(str, v)))}}}" for k, v in axes.items()))
    if not len(inc):
        return "\n".join(lines)
    if len(trained):
        lines.append(f"- **Depths** (n_layer): {distinct(trained['depth'])}; **Q/K inits**: "
                     f"{distinct(trained['qk_init'])}; **seeds**: {distinct(trained['seed'])}")
    if len(monitored):  # the monitor did not build the model: no init, no seed
        lines.append(f"- **Monitored model**: {distinct(monitored['qk_init'])}, depth "
                     f"{distinct(monitored['depth'])} (the monitor watched a model it did "
                     "not build: its Q/K init, e.g. pretrained, and seed are not known)")
    lines += [unit_line] if unit_line else []
    variants = [v for v in inc["variant"].unique() if v]
    if variants:
        lines.append(f"- **Other varying settings** (kept apart): "
                     f"{md_text(', '.join(variants))}")
    if len(trained):
        lines.append(f"- **Data**: {distinct(trained['data_source'])}; vocabulary "
                     f"{distinct(trained['vocab_size'])} characters")
    sizes = inc[inc["depth"] > 0].drop_duplicates("depth").sort_values("depth")
    if len(sizes):
        lines.append(_model_line(sizes))
    unknown = inc[inc["depth"] == 0]
    if len(unknown):
        lines.append(f"- **Model**: not recorded for {len(unknown)} run(s) (their "
                     "config.json holds no training config); depth 0 stands for unknown.")
    lines += _training_lines(trained, monitored, reference_line)
    lines += _time_lines(inc, trained)
    return "\n".join(lines + _loss_table(inc))


def _folder_line(data: Collated, runs: pd.DataFrame, inc: pd.DataFrame) -> str:
    if is_single_run(data.folder):
        state = "analysed" if len(inc) else "left out (below)"
        return f"- **Run folder**: {md_code(data.name)} ({md_text(data.folder)}); {state}."
    return (f"- **Sweep**: {md_code(data.name)} ({md_text(data.folder)}); {len(runs)} runs, "
            f"{len(inc)} analysed, {len(runs) - len(inc)} excluded (below).")


def _training_lines(trained: pd.DataFrame, monitored: pd.DataFrame,
                    reference_line: str) -> list[str]:
    """Steps, batch, tokens, rate and warm-up; what a monitored run does not record."""
    lines = []
    if len(trained):
        lines.append(f"- **Training**: {distinct(trained['steps'])} steps × batch "
                     f"{distinct(trained['batch_size'])} × {distinct(trained['block_size'])} "
                     f"tokens = {distinct(trained['tokens'], '{:,}')} tokens per run; peak lr "
                     f"{distinct(trained['lr'])}; LR warm-up "
                     f"{distinct(trained['warmup_steps'])} steps")
    if len(monitored):
        lines.append(f"- **Monitored** ({len(monitored)} run(s), `GeometryMonitor` in the "
                     f"user's own training loop): "
                     f"{distinct(monitored['steps'].where(monitored['steps'] > 0))} steps; the "
                     "loop's data, batch, learning rate and warm-up are not recorded "
                     "(config.json holds defaults for them) and not shown.")
    return lines + ([reference_line] if reference_line else [])


def _time_lines(inc: pd.DataFrame, trained: pd.DataFrame) -> list[str]:
    """Probes; the time in training steps and the wall-clock time of the sweep."""
    lines = [f"- **Probes**: every {distinct(inc['probe_every'])} steps plus step 0 and "
             f"the last, on {distinct(inc['probe_sequences'])} held-out sequences × context"]
    if "train_seconds" in trained and trained["train_seconds"].notna().any():
        ts = trained["train_seconds"].dropna()
        summed = (f", {_duration(float(ts.sum()))} summed over {len(ts)} runs"
                  if len(ts) > 1 else "")
        lines.append(f"- **Training time** (training steps only, from train_log "
                     f"throughput; probes and evals not counted): "
                     f"{'median ' if len(ts) > 1 else ''}{_duration(float(ts.median()))}"
                     f"{' per run' if len(ts) > 1 else ''}{summed}")
    if {"started", "ended"} <= set(trained.columns) and len(trained):
        start = pd.to_numeric(trained["started"], errors="coerce")
        end = pd.to_numeric(trained["ended"], errors="coerce")
        if not (start.isna().any() or end.isna().any()):
            lines.append(f"- **Wall-clock time**: {_duration(float(end.max() - start.min()))} "
                         "from the first run's start to the last run's end (status.json; runs "
                         "side by side overlap, a pause between attempts counts)")
    return lines


def _loss_table(inc: pd.DataFrame) -> list[str]:
    """The final validation loss per depth × init (× varying setting), over seeds."""
    if "final_val_loss" not in inc or not inc["final_val_loss"].notna().any():
        return []
    variants = any(v for v in inc["variant"].unique())
    vl = inc.groupby(["depth", "qk_init", "variant"])["final_val_loss"].agg(["mean", "std"])
    return ["", "Final validation loss (nats/char), mean ± sd over seeds:", "",
            md_table(["depth", "qk_init", *(["variant"] if variants else []), "val loss"],
                     [[d, md_text(i), *([md_text(v)] if variants else []),
                       f"{m:.3f}" + (f" ± {s:.3f}" if np.isfinite(s) else "")]
                      for (d, i, v), (m, s) in vl.iterrows()])]


def excluded_markdown(data: Collated) -> str:
    """The runs left out of every number, with their reason."""
    ex = data.excluded
    if ex.empty:
        return "## Excluded runs\n\nNone: every run of the sweep finished and is in the averages."
    return "\n".join([
        "## Excluded runs", "", f"{len(ex)} run(s) are left out of every average, count and "
        "figure:", "",
        md_table(["run", "depth", "qk_init", "seed", "state", "reason"],
                 [[md_code(r.run_id), md_text(r.depth), md_text(r.qk_init), md_text(r.seed),
                   md_text(r.state), md_text(r.excluded)] for r in ex.itertuples()])])


def missing_metrics(table: pd.DataFrame, wanted: Iterable[str]) -> list[str]:
    """The metrics of ``wanted`` that no row of the long ``table`` records."""
    have = set(table["metric"].unique()) if len(table) else set()
    return [m for m in wanted if m not in have]


#: The setting that records every metric, named wherever a report misses some: the
#: trainer always records all of them; a GeometryMonitor records its ``metrics=`` only.
RECORD_ALL = 'GeometryMonitor(..., metrics="all")'


def metrics_note(missing: Sequence[str], what: str) -> str:
    """One line saying which metrics are not recorded, what is skipped for it and which
    setting records them ("" if nothing is missing)."""
    if not missing:
        return ""
    names = ", ".join(f"`{m}`" for m in missing)
    return (f"**Not recorded here**: {names}. {what} `{RECORD_ALL}` records every metric "
            "(`qkgeom train` always does).")


def not_recorded_reason(missing: Iterable[str]) -> str:
    """A claim row's reason when the metrics it needs were not recorded."""
    return f"not recorded: {', '.join(missing)} ({RECORD_ALL} records them)"


# ---------------------------------------------------------------------------------------
# Figures in a report
# ---------------------------------------------------------------------------------------


@dataclass
class Drawn:
    """What a report's figure step gave: the PNGs drawn, those not drawn for want of
    metrics (``missing``) or because they would show nothing (``empty``: why), how they
    show the seeds, and whether figures were asked for."""

    pngs: dict[str, Path] = field(default_factory=dict)
    missing: dict[str, list[str]] = field(default_factory=dict)
    empty: dict[str, str] = field(default_factory=dict)
    spread: str = ""
    asked: bool = True


def figure_markdown(png: Path, caption: str, title: str = "") -> list[str]:
    """One figure in a report: its title, the PNG (linked to itself) and the caption
    naming the SVG beside it."""
    svg = png.with_suffix(".svg").name
    return [*([f"### {title}", ""] if title else []), f"[![{png.stem}]({png.name})]({png.name})",
            "", f"*{caption} Vector version: [{svg}]({svg}).*"]


# ---------------------------------------------------------------------------------------
# The page: report.md and a standalone report.html
# ---------------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em;
       line-height: 1.45; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; margin: 1em 0; display: block;
        overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.5em; vertical-align: top; }
th { background: #f3f3f3; text-align: left; }
tr.claim-group td { background: #e8eef5; font-weight: 600; border-top: 2px solid #8aa; }
td.verdict { min-width: 7em; }
td.v-supported { background: #d8f0de; color: #0f5132; }
td.v-not-supported { background: #f8dcd9; color: #842029; }
td.v-mixed { background: #fff0c2; color: #664d03; }
td.v-equivalent-to-no-effect { background: #dbe7f7; color: #0b3d6b; }
td.v-inconclusive { background: #f4f4f4; color: #333; }
td.v-not-evaluated { background: #ebebeb; color: #444; }
blockquote { margin: 1em 0; padding: 0.6em 1em; border-left: 4px solid #0072B2;
             background: #f2f7fb; font-size: 1.05em; }
img { max-width: 100%; height: auto; }
code { background: #f5f5f5; padding: 0 0.2em; }
"""

#: A PNG up to this size is embedded in report.html (a data URI); a larger one is shown
#: from its file beside the page, so the page stays small (keep the report folder whole).
EMBED_MAX_BYTES = 32_000


def verdict_class(text: str) -> str | None:
    """The CSS class of a verdict cell from its text (``not evaluated (reason)`` too), or
    None when the text is no verdict."""
    text = text.strip().lower()
    return next(("v-" + v.replace(" ", "-") for v in VERDICTS if text.startswith(v)), None)


def _cell_text(el: Any) -> str:
    return "".join(el.itertext()).strip()


def _style_table(table: Any) -> None:
    """A row whose cells after the first are empty becomes a group row (one cell across,
    class ``claim-group``); cells of a column headed "verdict…" get their verdict's class.
    Only attributes change: every value stays the escaped text."""
    heads = [_cell_text(th).lower() for th in table.iter("th")]
    verdict_cols = {i for i, h in enumerate(heads) if h.startswith("verdict")}
    for tr in table.iter("tr"):
        cells = [c for c in tr if c.tag == "td"]
        if len(cells) > 1 and _cell_text(cells[0]) and not any(
                _cell_text(c) for c in cells[1:]):
            for c in cells[1:]:
                tr.remove(c)
            cells[0].set("colspan", str(len(cells)))
            tr.set("class", "claim-group")
            continue
        for i in verdict_cols & set(range(len(cells))):
            kind = verdict_class(_cell_text(cells[i]))
            if kind:
                cells[i].set("class", f"verdict {kind}")


_URL_NOISE = re.compile(r"[\x00-\x20\x7f]+")  # what browsers drop from a URL's scheme


def _safe_link(href: str) -> bool:
    """A web, mail or relative address (entities and ignored control characters undone
    first): never ``javascript:`` or ``data:``."""
    url = _URL_NOISE.sub("", html.unescape(href))
    return (urlsplit(url).scheme.lower() if ":" in url else "") in ("", "http", "https",
                                                                      "mailto")


def _place_image(el: Any, folder: Path) -> None:
    """An existing PNG that ``el``'s src names inside ``folder`` (links resolved) is
    embedded when small, else shown from its file; any other image becomes its alt text,
    so nothing from elsewhere on the machine or the web enters the page."""
    root = folder.resolve()
    try:
        path = (root / el.get("src", "")).resolve()
        ok = path.suffix.lower() == ".png" and path.is_relative_to(root) and path.is_file()
    except (OSError, RuntimeError, ValueError):  # a bad name, a link loop
        ok = False
    if not ok:
        alt = el.get("alt", "")
        el.attrib.clear()
        el.tag, el.text = "span", alt
    elif path.stat().st_size <= EMBED_MAX_BYTES:
        el.set("src", "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode())
    else:
        el.set("src", path.relative_to(root).as_posix())
        el.set("loading", "lazy")


def render_html(markdown_text: str, folder: Path, title: str) -> str:
    """Markdown → standalone HTML: raw HTML shown as text (Markdown's HTML parsers off),
    links only to web, mail and relative addresses, images only PNGs inside ``folder``;
    claims tables get group rows and coloured verdict cells. (Not nh3 or bleach: they
    cannot turn a foreign image into its alt text, embed a local PNG or style a table.)"""
    import markdown  # the report extra; a missing one is named by the CLI (one line)
    from markdown.treeprocessors import Treeprocessor

    class Guard(Treeprocessor):
        def run(self, root: Any) -> None:
            for el in list(root.iter()):
                if el.tag == "a" and not _safe_link(el.get("href", "")):
                    del el.attrib["href"]
                elif el.tag == "img":
                    _place_image(el, folder)
                elif el.tag == "table":
                    _style_table(el)

    md = markdown.Markdown(extensions=["tables"])
    md.preprocessors.deregister("html_block")
    md.inlinePatterns.deregister("html")
    md.treeprocessors.register(Guard(md), "qkgeom_guard", 15)  # after inline (20)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n"
            f"<body>\n{md.convert(markdown_text)}\n</body></html>\n")


def write_pages(out: Path, text: str, title: str) -> Path:
    """``report.md`` and ``report.html`` into ``out``, atomically; returns ``report.md``."""
    md_path = out / "report.md"
    atomic_write(md_path, lambda p: p.write_text(text, encoding="utf-8"))
    page = render_html(text, out, title)
    atomic_write(out / "report.html", lambda p: p.write_text(page, encoding="utf-8"))
    return md_path


def write_csvs(out: Path, frames: Iterable[tuple[str, pd.DataFrame]]) -> None:
    """Each ``(name, frame)`` as ``out/name.csv`` (no index), atomically."""
    for name, frame in frames:
        atomic_write(out / f"{name}.csv", lambda p, f=frame: f.to_csv(p, index=False))
