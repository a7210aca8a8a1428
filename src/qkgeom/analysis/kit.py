"""The one kit every report shares (E1/E2, E3, E4 and a single run folder).

- **Markdown and numbers**: :func:`md_table`, :func:`fmt_p`, :func:`signed`, and the two
  escapes every value from a file goes through before it enters a report (:func:`md_text`,
  :func:`md_code`): grid and folder names, run ids, error texts, model and checkpoint names
  are data, never Markdown or HTML.
- **The claims table**: its columns (:data:`CLAIM_COLUMNS`, one row per claim × level ×
  origin) and :func:`claims_markdown`, which writes it with the cells an experiment's
  report chooses (:data:`SWEEP_CLAIM_CELLS` by default).
- **Sections of a sweep or run report**: :func:`setup_markdown`, :func:`excluded_markdown`,
  :func:`metrics_note` (metrics a folder does not record).
- **The page**: :func:`render_html` (standalone HTML, figures embedded; raw HTML never
  passes, links only to web or relative addresses, only PNGs inside the report folder
  embedded) and :func:`write_pages` (``report.md`` + ``report.html``, atomically).
- **Figure house style**: paper-column panels (:data:`PANEL_W` × :data:`PANEL_H` inches),
  8 pt text (:data:`STYLE`), colour-blind-safe colours (:func:`layer_colors`,
  :data:`MODE_COLORS`), :data:`REF_LINE`, :func:`new_figure`, :func:`grid`,
  :func:`suptitle`, :func:`step_axis` and :func:`save_figure` (PNG 300 dpi + SVG).

The text helpers need pandas only. The figure helpers import matplotlib when they are
called, so ``import qkgeom.analysis`` and a report without figures never load it, and they
draw on bare :class:`matplotlib.figure.Figure` objects: no pyplot, no global backend
switch, no figure registry to close.
"""

from __future__ import annotations

import base64
import html
import io
import re
import textwrap
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np
import pandas as pd

from qkgeom.analysis.collate import excluded_runs, is_single_run, runs_of, sweep_axes
from qkgeom.io import atomic_write

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

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

#: Columns of the E1/E2 and E3 claims tables (``claims.csv``): ``k`` of ``n`` independent
#: units (``unit``: runs, seeds) with the predicted sign; ``mean`` with its t-interval;
#: ``p_value`` = the sign-flip test (the verdict's), ``p_sign`` = the sign test beside it;
#: ``beside`` = the secondary evidence in words; ``reason`` = why a row is not evaluated.
CLAIM_COLUMNS = ["claim_id", "claim", "level", "origin", "from", "criterion", "unit", "k",
                 "n", "share", "measured", "mean", "ci_low", "ci_high", "estimate", "test",
                 "p_value", "p_sign", "beside", "verdict", "reason"]

#: A column of a claims table in Markdown: (header, cell of one claims record).
Cell = tuple[str, Callable[[dict[str, Any]], Any]]


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
#: The E1/E2 and E3 layout: where each row measures from, the units, the t-interval.
SWEEP_CLAIM_CELLS: tuple[Cell, ...] = (
    ("id", field("claim_id")), ("claim", field("claim")), ("level", field("level")),
    ("measured from", field("from")), ("units with the sign (k/n)", field("measured")),
    ("estimate [95 % t-interval]", field("estimate")), P_CELL, P_SIGN_CELL,
    ("beside", field("beside")), VERDICT_CELL)


def claims_markdown(claims: pd.DataFrame, cells: Sequence[Cell] = SWEEP_CLAIM_CELLS) -> str:
    """The claims table as Markdown, one row per claims record, in the columns ``cells``."""
    return md_table([header for header, _ in cells],
                    [[cell(r) for _, cell in cells] for r in claims.to_dict("records")])


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
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em;
       line-height: 1.45; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.5em; vertical-align: top; }
th { background: #f3f3f3; }
img { max-width: 100%; height: auto; }
code { background: #f5f5f5; padding: 0 0.2em; }
"""


def _web_png(path: Path, max_width: int = 1400) -> bytes:
    """The PNG scaled to ``max_width`` pixels and a 256-colour palette, for embedding: the
    300-dpi file of a full grid is several MB (the page links to it)."""
    from PIL import Image  # pillow: a matplotlib dependency

    with Image.open(path) as im:
        small = im.convert("RGB")
        if small.width > max_width:
            small = small.resize((max_width, round(im.height * max_width / im.width)),
                                 Image.Resampling.LANCZOS)
        buf = io.BytesIO()
        small.quantize(256, method=Image.Quantize.MEDIANCUT).save(buf, format="PNG",
                                                                   optimize=True)
        return buf.getvalue()


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
    dropped, images embedded when they are PNGs inside ``folder`` and else replaced by
    their alt text."""
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

        def _image(self, el: Any, parent: Any) -> None:
            path = _local_png(folder, el.get("src", ""))
            if path is not None:
                el.set("src", "data:image/png;base64,"
                       + base64.b64encode(_web_png(path)).decode("ascii"))
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
    """Markdown → standalone HTML. Raw HTML in the Markdown is shown as text, never passed
    through; links keep only web, mail and relative addresses; every PNG inside ``folder``
    (a relative path without ``..``) is embedded (as a data URI, at most 1400 px wide) and
    links to its full-resolution file, and any other image is left out (its alt text
    stays), so the page never carries a script or a file from elsewhere on the machine."""
    try:
        import markdown
    except ImportError as err:  # declared dependency; a clear message if it is missing
        raise ImportError("report.html needs the 'markdown' package: pip install markdown") from err
    body = markdown.markdown(markdown_text, extensions=["tables", _page_extension(folder)])
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n"
            f"<body>\n{body}\n</body></html>\n")


def write_pages(out: Path, text: str, title: str) -> Path:
    """``report.md`` and its self-contained ``report.html`` (page title ``title``) into
    ``out``, atomically; returns the path of ``report.md``."""
    md_path = out / "report.md"
    atomic_write(md_path, lambda p: p.write_text(text, encoding="utf-8"))
    page = render_html(text, out, title)
    atomic_write(out / "report.html", lambda p: p.write_text(page, encoding="utf-8"))
    return md_path


def write_csvs(out: Path, frames: Iterable[tuple[str, pd.DataFrame]]) -> None:
    """Each ``(name, frame)`` as ``out/name.csv`` (no index), atomically."""
    for name, frame in frames:
        atomic_write(out / f"{name}.csv", lambda p, f=frame: f.to_csv(p, index=False))


# ---------------------------------------------------------------------------------------
# Figure house style (matplotlib is imported by the functions that draw)
# ---------------------------------------------------------------------------------------

PANEL_W, PANEL_H = 3.4, 2.1  # inches per panel (a paper column)
STYLE = {
    "font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "xtick.labelsize": 7,
    "ytick.labelsize": 7, "legend.fontsize": 7, "legend.title_fontsize": 7,
    "axes.spines.top": False, "axes.spines.right": False, "svg.fonttype": "none",
    "figure.dpi": 100, "savefig.dpi": 300, "lines.linewidth": 1.2,
}
REF_LINE = {"color": "0.25", "linestyle": "--", "linewidth": 0.8, "zorder": 0}
# Key-control modes in Okabe–Ito colours (colour-blind safe); the baseline in grey.
MODE_COLORS = {"none": "0.35", "hold": "#0072B2", "shrink": "#D55E00", "expand": "#009E73",
               "sham": "#CC79A7"}


def layer_colors(n: int) -> np.ndarray:
    """n colours from viridis without its pale yellow end (readable on white, CB-safe)."""
    import matplotlib

    return matplotlib.colormaps["viridis"](np.linspace(0.0, 0.85, max(n, 1)))


def mode_color(arm: str) -> str:
    """The colour of a key-control mode or of an arm named after it (``shrink-0.5-data``);
    grey for one without its own."""
    return MODE_COLORS.get(arm.split("-", 1)[0], "0.6")


def new_figure(width: float, height: float) -> Figure:
    """A bare constrained-layout Figure (no pyplot): no global backend switch, no figure
    registry to leak or close."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def grid(n_rows: int, n_cols: int, height: float = PANEL_H, **kw: Any) -> tuple[Figure, np.ndarray]:
    """A figure of ``n_rows`` × ``n_cols`` paper-column panels; axes as a 2-D array."""
    fig = new_figure(PANEL_W * n_cols, height * n_rows)
    axes = fig.subplots(n_rows, n_cols, squeeze=False, **kw)
    return fig, axes


def suptitle(fig: Figure, text: str, n_cols: int) -> None:
    """A figure title wrapped to the figure's width (~60 characters per panel column)."""
    fig.suptitle(textwrap.fill(text, width=max(60 * n_cols, 60)), fontsize=9)


def step_axis(ax: Axes, max_step: float) -> None:
    """At most ~5 step ticks; thousands as "5k" once runs are long (no colliding labels)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
    if max_step >= 10_000:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k" if x else "0"))


def save_figure(fig: Figure, out_dir: str | Path, name: str) -> list[Path]:
    """Write ``name.png`` (300 dpi) and ``name.svg`` atomically."""
    import matplotlib

    out_dir = Path(out_dir)
    paths = []
    with matplotlib.rc_context(STYLE):
        for fmt in ("png", "svg"):
            path = out_dir / f"{name}.{fmt}"
            # constrained layout already fits titles, legends and colour bars
            atomic_write(path, lambda p, fmt=fmt: fig.savefig(p, format=fmt, dpi=300))
            paths.append(path)
    return paths
