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
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.collate import excluded_runs, is_single_run, runs_of, sweep_axes
from qkgeom.analysis.stats import SUPPORTED
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


def signed(x: float, digits: int = 3) -> str:
    """A signed number: ``digits`` decimals, or ``digits`` significant digits when
    0 < |x| < 0.01; ``n/a`` when not finite."""
    if not np.isfinite(x):
        return "n/a"
    return f"{x:+.{digits}g}" if abs(x) < 1e-2 and x != 0 else f"{x:+.{digits}f}"


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
            out.loc[rows, _adj_name(col)] = stats.holm(values) if adjust else values
    universal = out["universal_ok"] if "universal_ok" in out else pd.Series(None,
                                                                           index=out.index)
    out["verdict"] = [
        stats.verdict(int(r.k), int(r.n), r.p_adj, p_opposite=r.p_opposite_adj,
                      p_equiv=r.p_equiv_adj,
                      universal_ok=None if u is None or (isinstance(u, float) and np.isnan(u))
                      else bool(u), reason=r.reason)
        for r, u in zip(out.itertuples(), universal, strict=True)]
    return out


def _adj_name(col: str) -> str:
    """The column of ``col``'s adjusted value: p_value → p_adj, p_opposite → p_opposite_adj."""
    return "p_adj" if col == "p_value" else f"{col}_adj"


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
    row per claims record in the columns ``cells``."""
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

MONITOR_SOURCE = "qkgeom.monitor"  # the "source" a GeometryMonitor writes into config.json


def _n_params(r: pd.Series) -> int:
    if "n_params" in r and pd.notna(r["n_params"]):  # recorded (a monitored model)
        return int(r["n_params"])
    d, L = int(r["n_embd"]), int(r["depth"])
    per_layer = 12 * d * d + 2 * d + (11 * d if r.get("bias") else 0)
    return L * per_layer + int(r["vocab_size"]) * d + int(r["block_size"]) * d + d * (
        2 if r.get("bias") else 1)


def _range(values: pd.Series, fmt: str = "{}") -> str:
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


def _model_line(sizes: pd.DataFrame) -> str:
    def one(r: pd.Series) -> str:
        context = f"context {int(r['block_size'])}" if r["block_size"] else "context n/a"
        return (f"depth {int(r['depth'])}: {int(r['n_head'])} heads, d_model "
                f"{int(r['n_embd'])}, {context}, {_n_params(r) / 1e6:.2f} M parameters")
    return "- **Models**: " + "; ".join(one(r) for _, r in sizes.iterrows())


def _folder_line(table: pd.DataFrame, folder: Path, runs: pd.DataFrame,
                 inc: pd.DataFrame) -> str:
    name = table.attrs.get("name") or folder.name
    if is_single_run(folder):
        state = "analysed" if len(inc) else "left out (below)"
        return f"- **Run folder**: {md_code(name)} ({md_text(folder)}); {state}."
    return (f"- **Sweep**: {md_code(name)} ({md_text(folder)}); {len(runs)} runs, {len(inc)} "
            f"analysed, {len(runs) - len(inc)} excluded (below).")


def setup_markdown(table: pd.DataFrame, sweep_dir: Path, traj: pd.DataFrame,
                   trajectories: bool = True) -> str:
    """Grid, data, model sizes, tokens, seeds, reference steps and wall time of a sweep or
    of one run folder. ``trajectories=False`` (E3, whose unit is the seed) leaves out the
    E1 trajectory count and the reference probe used by the E1/E2 statistics.

    Facts a folder does not record are left out with a note: runs whose ``config.json``
    holds no training config, and runs a :class:`~qkgeom.monitor.GeometryMonitor` watched
    (its record knows the model and probes, not the training loop's data, batch or rate)."""
    runs = runs_of(table)
    spec = table.attrs.get("sweep") or {}
    inc = runs[runs["excluded"] == ""] if len(runs) else runs
    lines = ["## Setup", "", _folder_line(table, sweep_dir, runs, inc)]
    axes = sweep_axes(spec)
    if axes:
        grid = spec.get("grid", {})
        preset = f" on preset {md_code(grid['preset'])}" if grid.get("preset") else ""
        lines.append(f"- **Grid** (sweep.json){preset}: " + "; ".join(
            f"{md_code(k)} ∈ {{{md_text(', '.join(map(str, v)))}}}" for k, v in axes.items()))
    if len(inc):
        monitored = inc[inc["source"] == MONITOR_SOURCE] if "source" in inc else inc.iloc[:0]
        trained = inc.drop(monitored.index)
        unknown = inc[inc["depth"] == 0]
        lines.append(f"- **Depths** (n_layer): {_range(inc['depth'])}; **Q/K inits**: "
                     f"{_range(inc['qk_init'])}; **seeds**: {_range(inc['seed'])}")
        per = inc.groupby(["depth", "qk_init", "variant"])["seed"].nunique()
        if trajectories:
            lines.append(f"- **Seeds per depth × init**: {per.min()}–{per.max()}; "
                         f"**trajectories** (depth × init × layer): "
                         f"{int(inc.drop_duplicates(['depth', 'qk_init', 'variant'])['depth'].sum())}")
        variants = [v for v in inc["variant"].unique() if v]
        if variants:
            lines.append(f"- **Other varying settings** (kept apart): "
                         f"{md_text(', '.join(variants))}")
        if len(trained):
            lines.append(f"- **Data**: {_range(trained['data_source'])}; vocabulary "
                         f"{_range(trained['vocab_size'])} characters")
        sizes = inc[inc["depth"] > 0].drop_duplicates("depth").sort_values("depth")
        if len(sizes):
            lines.append(_model_line(sizes))
        if len(unknown):
            lines.append(f"- **Model**: not recorded for {len(unknown)} run(s) (their "
                         "config.json holds no training config); depth 0 stands for unknown.")
        if len(trained):
            lines.append(f"- **Training**: {_range(trained['steps'])} steps × batch "
                         f"{_range(trained['batch_size'])} × {_range(trained['block_size'])} "
                         f"tokens = {_range(trained['tokens'], '{:,}')} tokens per run; peak lr "
                         f"{_range(trained['lr'])}; LR warm-up {_range(trained['warmup_steps'])} "
                         "steps")
        if len(monitored):
            lines.append(f"- **Monitored** ({len(monitored)} run(s), `GeometryMonitor` in the "
                         f"user's own training loop): "
                         f"{_range(monitored['steps'].where(monitored['steps'] > 0))} steps; the "
                         "loop's data, batch, learning rate, warm-up and Q/K init are not "
                         "recorded (config.json holds defaults for them).")
        ref_used = (sorted(traj.loc[traj["origin"] == "reference", "start_step"].unique())
                    if len(traj) else [])
        if trajectories:
            lines.append(f"- **Reference step** (configured): {_range(inc['ref_step'])}; first "
                         f"probe at or after it (used): {', '.join(map(str, ref_used)) or 'n/a'}")
        lines.append(f"- **Probes**: every {_range(inc['probe_every'])} steps plus step 0 and the "
                     f"last, on {_range(inc['probe_sequences'])} held-out sequences × context")
        if "train_seconds" in trained and trained["train_seconds"].notna().any():
            ts = trained["train_seconds"].dropna()
            lines.append(f"- **Wall time** (training steps, from train_log throughput; probes "
                         f"and evals not counted): median {_duration(float(ts.median()))} per "
                         f"run, {_duration(float(ts.sum()))} in all")
        if "final_val_loss" in inc and inc["final_val_loss"].notna().any():
            vl = inc.groupby(["depth", "qk_init", "variant"])["final_val_loss"].agg(["mean", "std"])
            lines += ["", "Final validation loss (nats/char), mean ± sd over seeds:", ""]
            lines.append(md_table(
                ["depth", "qk_init", *(["variant"] if variants else []), "val loss"],
                [[d, md_text(i), *([md_text(v)] if variants else []),
                  f"{m:.3f}" + (f" ± {s:.3f}" if np.isfinite(s) else "")]
                 for (d, i, v), (m, s) in vl.iterrows()]))
    return "\n".join(lines)


def excluded_markdown(table: pd.DataFrame) -> str:
    """The runs left out of every number, with their reason."""
    ex = excluded_runs(table)
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


def metrics_note(missing: Sequence[str], what: str) -> str:
    """One line saying which metrics are not recorded and what is skipped for it ("" if
    nothing is missing)."""
    if not missing:
        return ""
    names = ", ".join(f"`{m}`" for m in missing)
    return f"**Not recorded here**: {names}. {what}"


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


def _local_png(folder: Path, src: str) -> Path | None:
    """The PNG file ``src`` names inside ``folder`` (a relative path without ``..``), or
    None: nothing outside the report folder is ever read into the page."""
    src = html.unescape(src)
    if _URL_NOISE.search(src) or ":" in src or "\\" in src:
        return None
    rel = PurePosixPath(src)
    if rel.is_absolute() or ".." in rel.parts or rel.suffix.lower() != ".png":
        return None
    root = folder.resolve()
    path = (root / rel).resolve()
    return path if path.is_file() and path.is_relative_to(root) else None


def _page_extension(folder: Path) -> Any:
    """A Python-Markdown extension: raw HTML off (it is shown as text), unsafe links
    dropped, images kept only when they are PNGs inside ``folder`` (embedded when small,
    else shown from their file) and else replaced by their alt text; tables styled
    (:func:`_style_table`)."""
    from markdown.extensions import Extension
    from markdown.treeprocessors import Treeprocessor

    class Guard(Treeprocessor):
        def run(self, root: Any) -> None:
            parents = {child: parent for parent in root.iter() for child in parent}
            for el in list(root.iter()):
                if el.tag == "a" and not _safe_link(el.get("href", "")):
                    del el.attrib["href"]
                elif el.tag == "img":
                    self._image(el, parents.get(el))
                elif el.tag == "table":
                    _style_table(el)

        def _image(self, el: Any, parent: Any) -> None:
            path = _local_png(folder, el.get("src", ""))
            if path is not None:
                if path.stat().st_size <= EMBED_MAX_BYTES:
                    el.set("src", "data:image/png;base64,"
                           + base64.b64encode(path.read_bytes()).decode("ascii"))
                else:
                    el.set("src", path.relative_to(folder.resolve()).as_posix())
                    el.set("loading", "lazy")
                return
            if parent is not None:  # the alt text in place of the image
                alt = el.get("alt", "")
                index = list(parent).index(el)
                if index == 0:
                    parent.text = (parent.text or "") + alt + (el.tail or "")
                else:
                    prev = parent[index - 1]
                    prev.tail = (prev.tail or "") + alt + (el.tail or "")
                parent.remove(el)

    class Page(Extension):
        def extendMarkdown(self, md: Any) -> None:  # noqa: N802 - Markdown's API
            md.preprocessors.deregister("html_block")
            md.inlinePatterns.deregister("html")
            md.treeprocessors.register(Guard(md), "qkgeom_guard", 15)  # after inline (20)

    return Page()


def render_html(markdown_text: str, folder: Path, title: str) -> str:
    """Markdown → HTML. Raw HTML in the Markdown is shown as text, never passed through;
    links keep only web, mail and relative addresses; a PNG inside ``folder`` (a relative
    path without ``..``) is embedded as a data URI when it is at most
    :data:`EMBED_MAX_BYTES`, else shown from its file beside the page (the figures of a
    report: the page stays small and opens from its folder); any other image is left out
    (its alt text stays), so the page never carries a script or a file from elsewhere on
    the machine. Claims tables get group rows and coloured verdict cells
    (:func:`_style_table`)."""
    try:
        import markdown
    except ImportError as err:  # declared dependency; a clear message if it is missing
        raise ImportError("report.html needs the 'markdown' package: pip install markdown") from err
    body = markdown.markdown(markdown_text, extensions=["tables", _page_extension(folder)])
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n"
            f"<body>\n{body}\n</body></html>\n")


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
