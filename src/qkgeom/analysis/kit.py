"""The one kit every report shares (E1/E2, E3, E4 and a single run folder): its text.

- **Markdown and numbers**: :func:`md_table`, :func:`fmt_p`, :func:`signed`, and the two
  escapes every value from a file goes through before it enters a report (:func:`md_text`,
  :func:`md_code`): grid and folder names, run ids, error texts, model and checkpoint names
  are data, never Markdown or HTML.
- **The claims table**: its columns (:data:`CLAIM_COLUMNS`, one row per claim × level ×
  origin) and :func:`claims_markdown`, which writes it grouped by claim (the claim's id and
  text once, in a group row, then its rows) with the cells an experiment's report chooses
  (:data:`SWEEP_CLAIM_CELLS` by default); :func:`claims_summary`, the one line that opens
  every report ("E1/E2: k of n claims supported, …", read on the primary rows).
- **Sections of a sweep or run report**: :func:`setup_markdown`, :func:`excluded_markdown`,
  :func:`metrics_note` (metrics a folder does not record).
- **The page**: :func:`render_html` (standalone HTML: raw HTML never passes, links only to
  web or relative addresses, images only from PNGs inside the report folder; verdict
  cells coloured, with their words kept) and :func:`write_pages` (``report.md`` +
  ``report.html``, atomically).

The figure house style is :mod:`qkgeom.analysis.figstyle`. Everything here needs pandas
only (and ``markdown`` for the page).
"""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.collate import MONITOR_SOURCE, Collated, is_single_run, sweep_axes
from qkgeom.analysis.stats import ALPHA, SUPPORTED
from qkgeom.io import atomic_write

# ---------------------------------------------------------------------------------------
# Markdown and numbers
# ---------------------------------------------------------------------------------------


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table; ``|`` and newlines inside cells are escaped."""
    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


_MD_SPECIAL = re.compile(r"([\\`*_\[\]#!])")


def md_text(value: Any) -> str:
    """``value`` as literal Markdown text on one line: Markdown syntax characters
    backslash-escaped, ``&``, ``<`` and ``>`` as entities (so neither Markdown nor HTML in a
    name, run id or error message does anything). ``|`` is left to :func:`md_table`, which
    escapes it in cells (elsewhere a one-line value cannot start a table)."""
    text = " ".join(str(value).split())
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", text)


def md_code(value: Any) -> str:
    """``value`` as an inline code span on one line, whatever backticks it holds (the fence
    is longer than any run of backticks inside)."""
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
    """A signed number: ``digits`` decimals, or ``digits`` significant digits when
    1e-6 ≤ |x| < 0.01; ``0.000`` (no sign) below :data:`ZERO_BELOW`; ``n/a`` when not
    finite."""
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

#: Columns of the E1/E2 and E3 claims tables (``claims.csv``): ``role`` (``primary``: the
#: row declared in docs/protocols.md that decides the claim; ``secondary``: descriptive);
#: ``k`` of ``n`` independent units (``unit``: runs, seeds) with the predicted sign;
#: ``mean`` with its t-interval; ``p_value`` = the sign-flip test in the predicted
#: direction (the verdict's), ``p_opposite`` in the other, ``p_sign`` = the sign test;
#: ``delta`` and ``p_equiv`` = the smallest effect of interest and the equivalence test
#: (NaN where none is declared); ``detectable`` = the smallest effect the units find with
#: 80 % power at their spread; ``*_adj`` = the p's after Holm's adjustment within the row's
#: family (``family``: how many rows it holds); ``beside`` = context in words; ``reason`` =
#: why a row is not evaluated.
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
              reason: str = "", **extra: Any) -> dict[str, Any]:
    """One row of a claims table, every experiment's (:data:`CLAIM_COLUMNS`; :func:`decide`
    adds the adjusted p's and the verdict): ``k``, ``n`` and the numbers ``u`` has of
    :func:`qkgeom.analysis.stats.unit_test`'s (NaN for those it lacks); ``extra``: the
    experiment's own columns (``origin``, ``from``, ``criterion``, ``delta``, ...)."""
    nan = float("nan")
    return {"claim_id": claim_id, "claim": claim, "role": role, "level": level, "unit": unit,
            "measured": measured, "k": u["k"], "n": u["n"],
            **{key: u.get(key, nan) for key in _UNIT_NUMBERS}, "estimate": estimate,
            "test": test, "beside": beside, "reason": reason, **extra}


#: A column of a claims table in Markdown: (header, cell of one claims record).
Cell = tuple[str, Callable[[dict[str, Any]], Any]]

VERDICTS = stats.VERDICTS


def decide(claims: pd.DataFrame, *, holm_primary: bool) -> pd.DataFrame:
    """The adjusted p's and the verdict of every row of a claims table.

    Rows are in two families by ``role``: the primary rows (one per claim), Holm-adjusted
    together when ``holm_primary`` (E1/E2, whose claims are read as one family) or each at
    α (E3, one confirmatory row per claim), and the secondary rows, always Holm-adjusted
    together. A row that is not evaluated (a ``reason``, or no unit) is in no family. The
    verdict is :func:`qkgeom.analysis.stats.verdict` on the adjusted p's (``universal_ok``,
    when the table has it, for universal claims)."""
    out = claims.copy()
    for col in ("p_opposite", "p_equiv", "delta", "detectable"):
        if col not in out:
            out[col] = np.nan
    if "role" not in out:
        out["role"] = "primary"
    reason = out["reason"].fillna("").astype(str) if "reason" in out else pd.Series(
        "", index=out.index)
    out["reason"] = reason
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
    universal = out["universal_ok"] if "universal_ok" in out else pd.Series(None,
                                                                           index=out.index)
    out["verdict"] = [
        stats.verdict(int(r.k), int(r.n), r.p_adj, p_opposite=r.p_opposite_adj,
                      p_equiv=r.p_equiv_adj,
                      universal_ok=None if u is None or (isinstance(u, float) and np.isnan(u))
                      else bool(u), reason=r.reason)
        for r, u in zip(out.itertuples(), universal, strict=True)]
    return out


def field(key: str) -> Callable[[dict[str, Any]], Any]:
    """The cell that shows the record's ``key`` as it is."""
    return lambda r: r[key]


def verdict_text(r: dict[str, Any]) -> str:
    """The verdict in bold, with the reason when there is one (*not evaluated*)."""
    reason = r.get("reason")
    tail = f" ({reason})" if isinstance(reason, str) and reason else ""
    return f"**{r['verdict']}**{tail}"


P_CELL: Cell = ("p (sign-flip, one-sided)", lambda r: fmt_p(r["p_value"]))
P_SIGN_CELL: Cell = ("p (sign test)", lambda r: fmt_p(r["p_sign"]))
VERDICT_CELL: Cell = ("verdict", verdict_text)
#: The E1/E2 and E3 layout under each claim's group row: level, where each row measures
#: from, the units, the t-interval.
SWEEP_CLAIM_CELLS: tuple[Cell, ...] = (
    ("level", field("level")), ("measured from", field("from")),
    ("units with the sign (k/n)", field("measured")),
    ("estimate [95 % t-interval]", field("estimate")), P_CELL, P_SIGN_CELL,
    ("beside", field("beside")), VERDICT_CELL)


#: Units a claims table may decide verdicts over: independent runs (E1/E2) or seeds (E3).
#: E4's unit, a layer of one model, is not independent; its report says so itself.
INDEPENDENT_UNITS = ("runs", "seeds")


#: Fewer independent units than this give a descriptive report, no verdicts: the smallest
#: exact sign-flip p of n units is 1/2^n, which must fall below α.
MIN_UNITS = math.floor(-math.log2(ALPHA)) + 1


def _unit_word(n: int, unit: str) -> str:
    return unit[:-1] if n == 1 and unit.endswith("s") else unit


def units_measured(claims: pd.DataFrame) -> tuple[int, str] | None:
    """``(n, unit)``: the most independent units any row of ``claims`` measured, and what
    they are; None for a table whose unit is not independent (E4) or that has no rows."""
    if claims.empty or not {"n", "unit"} <= set(claims.columns):
        return None
    units = [str(u) for u in claims["unit"].dropna().unique()]
    if not units or not set(units) <= set(INDEPENDENT_UNITS):
        return None
    n = pd.to_numeric(claims["n"], errors="coerce").max()
    return (int(n) if np.isfinite(n) else 0), units[0]


def descriptive_reason(claims: pd.DataFrame) -> str:
    """The one line that makes a report descriptive ("" when it is not): fewer than
    :data:`MIN_UNITS` independent units, whose sign-flip p can never fall below the
    verdict's level, so no row gets a verdict."""
    measured = units_measured(claims)
    if measured is None or measured[0] >= MIN_UNITS:
        return ""
    n, unit = measured
    floor = (f"the exact sign-flip p of {n} {_unit_word(n, unit)} is at least "
             f"1/2^{n} = {0.5 ** n:.3g}" if n else f"no {_unit_word(2, unit)} measured")
    return (f"Descriptive: {n} {_unit_word(n, unit)}. A verdict needs at least {MIN_UNITS} "
            f"{unit} ({floor}, never below {ALPHA}), so its claims table shows what was "
            "measured, with no verdict.")


def _note(r: dict[str, Any]) -> str:
    reason = r.get("reason")
    return reason if isinstance(reason, str) else ""


NOTE_CELL: Cell = ("note", _note)


def descriptive_cells(claims: pd.DataFrame, cells: Sequence[Cell]) -> tuple[Cell, ...]:
    """``cells`` without the verdict for a descriptive table (:func:`descriptive_reason`);
    a row's reason (why it could not be measured) then stands in a ``note`` column, when
    any row has one."""
    if not descriptive_reason(claims):
        return tuple(cells)
    kept = tuple(c for c in cells if c[0] != VERDICT_CELL[0])
    has_note = "reason" in claims and claims["reason"].fillna("").astype(str).str.len().any()
    return (*kept, NOTE_CELL) if has_note else kept


def claim_groups(claims: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """``(claim_id, claim, rows)`` per claim (one id and text: an E3 claim is one claim per
    arm, its text names the arm), in the order claims first appear, each with its rows in
    table order (E4's table lists every claim per level: its rows are gathered here)."""
    if claims.empty:
        return []
    keys = list(zip(claims["claim_id"].astype(str), claims["claim"].astype(str),
                    strict=True))
    order = list(dict.fromkeys(keys))
    rows: dict[tuple[str, str], list[int]] = {k: [] for k in order}
    for i, key in enumerate(keys):
        rows[key].append(i)
    return [(cid, text, claims.iloc[rows[(cid, text)]]) for cid, text in order]


def claims_markdown(claims: pd.DataFrame, cells: Sequence[Cell] = SWEEP_CLAIM_CELLS) -> str:
    """The claims table as Markdown, grouped by claim: a group row holding the claim's id
    and text (its other cells empty; ``report.html`` spans it across the table), then one
    row per claims record in the columns ``cells`` (a descriptive table, of fewer than
    :data:`MIN_UNITS` units, has no verdict column: :func:`descriptive_cells`)."""
    cells = descriptive_cells(claims, cells)
    header = [f"claim / {cells[0][0]}", *(h for h, _ in cells[1:])]
    rows: list[list[Any]] = []
    for claim_id, claim, group in claim_groups(claims):
        rows.append([f"{claim_id} · **{claim}**", *([""] * (len(cells) - 1))])
        rows += [[cell(r) for _, cell in cells] for r in group.to_dict("records")]
    return md_table(header, rows)


def verdict_counts(claims: pd.DataFrame) -> dict[str, int]:
    """Rows of the claims table per verdict (every verdict present, zeros included)."""
    counts = claims["verdict"].value_counts() if len(claims) else pd.Series(dtype=int)
    return {v: int(counts.get(v, 0)) for v in VERDICTS}


def primary_rows(claims: pd.DataFrame) -> pd.DataFrame:
    """The rows that decide the claims (all rows of a table without roles)."""
    return claims[claims["role"] == "primary"] if "role" in claims else claims


def claims_summary(claims: pd.DataFrame) -> str:
    """The one line that opens a report: which experiment and the verdicts of its claims,
    read on their primary rows ("E1/E2: 3 of 6 claims supported, 1 mixed, 2 inconclusive,
    … (primary rows; 16 secondary rows below)"). Plain text: the counts are the verdicts of
    ``claims``, nothing else."""
    if claims.empty:
        return "No claims could be evaluated."
    families = sorted({str(c).split(".", 1)[0] for c in claims["claim_id"]},
                      key=lambda f: (len(f), f))
    measured = units_measured(claims) if descriptive_reason(claims) else None
    if measured is not None:  # too few units for any verdict: count what was measured
        n, unit = measured
        empty = int((pd.to_numeric(claims["n"], errors="coerce").fillna(0) == 0).sum())
        return (f"{'/'.join(families)}: descriptive, {n} {_unit_word(n, unit)} (a verdict "
                f"needs at least {MIN_UNITS}): {len(claims)} claim rows, "
                f"{len(claims) - empty} measured, {empty} not measurable "
                f"({len(claim_groups(claims))} claims)")
    primary = primary_rows(claims)
    counts = verdict_counts(primary)
    rest = ", ".join(f"{counts[v]} {v}" for v in VERDICTS[1:] if counts[v])
    secondary = len(claims) - len(primary)
    tail = f" (primary rows; {secondary} secondary rows below)" if secondary else ""
    return (f"{'/'.join(families)}: {counts[SUPPORTED]} of {len(primary)} claims "
            f"{SUPPORTED}{', ' + rest if rest else ''}{tail}")


def summary_markdown(claims: pd.DataFrame) -> str:
    """:func:`claims_summary` as the report's opening line (a quote, set off as a banner
    in ``report.html``)."""
    return f"> **{claims_summary(claims)}**"


# ---------------------------------------------------------------------------------------
# Sections of a sweep or run-folder report
# ---------------------------------------------------------------------------------------



def _n_params(r: pd.Series) -> int:
    if "n_params" in r and pd.notna(r["n_params"]):  # recorded (a monitored model)
        return int(r["n_params"])
    d, L = int(r["n_embd"]), int(r["depth"])
    per_layer = 12 * d * d + 2 * d + (11 * d if r.get("bias") else 0)
    return L * per_layer + int(r["vocab_size"]) * d + int(r["block_size"]) * d + d * (
        2 if r.get("bias") else 1)


def distinct(values: pd.Series, fmt: str = "{}") -> str:
    """The distinct values, sorted, as Markdown text (``n/a`` for none)."""
    vals = sorted({v for v in values.dropna().tolist()}, key=lambda v: (str(type(v)), v))
    if not vals:
        return "n/a"
    return md_text(", ".join(fmt.format(v) for v in vals))


def _duration(seconds: float) -> str:
    if not np.isfinite(seconds):
        return "n/a"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _wall_clock(runs: pd.DataFrame) -> float | None:
    """Seconds from the first run's start to the last run's last write (None when the
    runs do not record both)."""
    if not {"started", "ended"} <= set(runs.columns) or runs.empty:
        return None
    start = pd.to_numeric(runs["started"], errors="coerce")
    end = pd.to_numeric(runs["ended"], errors="coerce")
    if start.isna().any() or end.isna().any():
        return None
    return float(end.max() - start.min())


def _model_line(sizes: pd.DataFrame) -> str:
    def one(r: pd.Series) -> str:
        context = f"context {int(r['block_size'])}" if r["block_size"] else "context n/a"
        if r.get("source") == MONITOR_SOURCE:  # the probe's length, not the model's context
            context = f"probes of {int(r['block_size'])} tokens"
        return (f"depth {int(r['depth'])}: {int(r['n_head'])} heads, d_model "
                f"{int(r['n_embd'])}, {context}, {_n_params(r) / 1e6:.2f} M parameters")
    return "- **Models**: " + "; ".join(one(r) for _, r in sizes.iterrows())


def run_groups(data: Collated) -> tuple[pd.DataFrame, ...]:
    """``(runs, included, trained, monitored)``: every run :func:`collate` listed, those
    in the numbers, and of these the ones qkgeom trained and the ones a
    :class:`~qkgeom.monitor.GeometryMonitor` watched in the user's own loop."""
    runs, inc = data.runs, data.included
    monitored = inc[inc["source"] == MONITOR_SOURCE] if "source" in inc else inc.iloc[:0]
    return runs, inc, inc.drop(monitored.index), monitored


def setup_markdown(data: Collated, *, unit_line: str = "", reference_line: str = "") -> str:
    """Grid, data, model sizes, tokens, seeds, probes and time of a sweep or of one run
    folder; an experiment adds its own lines: ``unit_line`` (after the models: what its
    statistics count) and ``reference_line`` (before the probes). ``_traj`` and
    ``trajectories`` are unused (E3's call still passes them).

    Facts a folder does not record are left out with a note: runs whose ``config.json``
    holds no training config, and runs a :class:`~qkgeom.monitor.GeometryMonitor` watched
    (its record knows the model and probes, not the training loop's data, batch or rate)."""
    runs, inc, trained, monitored = run_groups(data)
    spec = data.sweep
    lines = ["## Setup", "", _folder_line(data.name, data.folder, runs, inc)]
    axes = sweep_axes(spec)
    if axes:
        grid = spec.get("grid", {})
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
    return "\n".join(lines + _training_lines(inc, trained, monitored, reference_line))


def _folder_line(name: str, folder: Path, runs: pd.DataFrame, inc: pd.DataFrame) -> str:
    if is_single_run(folder):
        state = "analysed" if len(inc) else "left out (below)"
        return f"- **Run folder**: {md_code(name)} ({md_text(folder)}); {state}."
    return (f"- **Sweep**: {md_code(name)} ({md_text(folder)}); {len(runs)} runs, {len(inc)} "
            f"analysed, {len(runs) - len(inc)} excluded (below).")


def _training_lines(inc: pd.DataFrame, trained: pd.DataFrame, monitored: pd.DataFrame,
                    reference_line: str) -> list[str]:
    """Steps, batch, tokens and rate; probes; training and wall-clock time; the final
    validation loss per depth × init (× varying setting), over seeds."""
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
    lines += [reference_line] if reference_line else []
    lines.append(f"- **Probes**: every {distinct(inc['probe_every'])} steps plus step 0 and "
                 f"the last, on {distinct(inc['probe_sequences'])} held-out sequences × context")
    if "train_seconds" in trained and trained["train_seconds"].notna().any():
        ts = trained["train_seconds"].dropna()
        summed = (f", {_duration(float(ts.sum()))} summed over {len(ts)} runs"
                  if len(ts) > 1 else "")
        lines.append(f"- **Training time** (training steps only, from train_log "
                     f"throughput; probes and evals not counted): "
                     f"{'median ' if len(ts) > 1 else ''}{_duration(float(ts.median()))}"
                     f"{' per run' if len(ts) > 1 else ''}{summed}")
    wall = _wall_clock(trained)
    if wall is not None:
        lines.append(f"- **Wall-clock time**: {_duration(wall)} from the first run's "
                     "start to the last run's end (status.json; runs side by side "
                     "overlap, a pause between attempts counts)")
    if "final_val_loss" not in inc or not inc["final_val_loss"].notna().any():
        return lines
    variants = any(v for v in inc["variant"].unique())
    vl = inc.groupby(["depth", "qk_init", "variant"])["final_val_loss"].agg(["mean", "std"])
    return [*lines, "", "Final validation loss (nats/char), mean ± sd over seeds:", "",
            md_table(["depth", "qk_init", *(["variant"] if variants else []), "val loss"],
                     [[d, md_text(i), *([md_text(v)] if variants else []),
                       f"{m:.3f}" + (f" ± {s:.3f}" if np.isfinite(s) else "")]
                      for (d, i, v), (m, s) in vl.iterrows()])]


def excluded_markdown(data: Collated) -> str:
    """The runs left out of every number, with their reason."""
    ex = data.excluded
    lines = ["## Excluded runs", ""]
    if ex.empty:
        lines.append("None: every run of the sweep finished and is in the averages.")
        return "\n".join(lines)
    lines.append(f"{len(ex)} run(s) are left out of every average, count and figure:")
    lines.append("")
    lines.append(md_table(["run", "depth", "qk_init", "seed", "state", "reason"],
                          [[md_code(r.run_id), md_text(r.depth), md_text(r.qk_init),
                            md_text(r.seed), md_text(r.state), md_text(r.excluded)]
                           for r in ex.itertuples()]))
    return "\n".join(lines)


def missing_metrics(table: pd.DataFrame, wanted: Iterable[str]) -> list[str]:
    """The metrics of ``wanted`` that no row of the collated ``table`` records."""
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
    for v in VERDICTS:
        if text.startswith(v):
            return "v-" + v.replace(" ", "-")
    return None


def _cell_text(el: Any) -> str:
    return "".join(el.itertext()).strip()


def _style_table(table: Any) -> None:
    """A row whose cells after the first are all empty becomes a group row (one cell
    across the table, class ``claim-group``); cells of a column headed "verdict…" get the
    class of their verdict. Only attributes change: every value stays the escaped text."""
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


_SAFE_SCHEMES = ("http", "https", "mailto")
_URL_NOISE = re.compile(r"[\x00-\x20\x7f]+")  # what browsers drop from a URL's scheme


def _safe_link(href: str) -> bool:
    """A web, mail or relative address (after undoing entities and the control characters
    a browser ignores): never ``javascript:`` or ``data:``."""
    url = _URL_NOISE.sub("", html.unescape(href))
    scheme = urlsplit(url).scheme.lower() if ":" in url else ""
    return scheme in ("", *_SAFE_SCHEMES)


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
    """Markdown → standalone HTML. Raw HTML in the Markdown is shown as text (Markdown's
    own escaping, its HTML parsers off); links keep only web, mail and relative addresses;
    images only PNGs inside ``folder`` (:func:`_place_image`; embedded up to
    :data:`EMBED_MAX_BYTES`, so the page stays small and opens from its folder). Claims
    tables get group rows and coloured verdict cells (:func:`_style_table`)."""
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
    """``report.md`` and ``report.html`` (page title ``title``; it shows the figures
    beside it in ``out``) into ``out``, atomically; returns the path of ``report.md``."""
    md_path = out / "report.md"
    atomic_write(md_path, lambda p: p.write_text(text, encoding="utf-8"))
    page = render_html(text, out, title)
    atomic_write(out / "report.html", lambda p: p.write_text(page, encoding="utf-8"))
    return md_path


def write_csvs(out: Path, frames: Iterable[tuple[str, pd.DataFrame]]) -> None:
    """Each ``(name, frame)`` as ``out/name.csv`` (no index), atomically."""
    for name, frame in frames:
        atomic_write(out / f"{name}.csv", lambda p, f=frame: f.to_csv(p, index=False))
