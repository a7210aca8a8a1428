"""The figure house style every report shares (E1/E2, E3, E4).

Sized so a figure stays readable in report.html on an 800-px page, colour-blind safe,
layers never black or grey (the legend keys' and reference lines' colours). Why each
number: docs/report.md#figures. matplotlib is imported by the functions that draw; figures
are bare ``Figure`` objects (no pyplot, no backend switch, no registry to close).
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from qkgeom.analysis.stats import t_interval
from qkgeom.io import atomic_write

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PANEL_W, PANEL_H = 2.9, 2.1  # inches per panel
#: Panels across a figure at most: 3 × PANEL_W plus a legend is about 9.7 in, which an
#: 800-px page shows at about 1.1 px per point (9 pt text: a 10-px em).
MAX_COLS = 3
LEGEND_W = 1.0  # inches beside the panels for a legend of layers
#: PNG resolution: sharp on a screen (2x a 100-dpi layout) at a quarter of 300 dpi's
#: pixels; the SVG beside each PNG is the copy for print.
SCREEN_DPI = 150
TITLE_PT = 10  # the figure's title (suptitle)
STYLE = {
    "font.size": 9, "axes.titlesize": 9, "axes.labelsize": 9, "xtick.labelsize": 9,
    "ytick.labelsize": 9, "legend.fontsize": 9, "legend.title_fontsize": 9,
    "axes.spines.top": False, "axes.spines.right": False, "svg.fonttype": "none",
    "figure.dpi": 100, "savefig.dpi": SCREEN_DPI, "lines.linewidth": 1.3,
}
REF_LINE = {"color": "0.45", "linestyle": ":", "linewidth": 0.9, "zorder": 0}
ZERO_LINE = {"color": "0.6", "linewidth": 0.6, "zorder": 0}
# Key-control modes in Okabe–Ito colours (colour-blind safe); the baseline in grey.
MODE_COLORS = {"none": "0.35", "hold": "#0072B2", "shrink": "#D55E00", "expand": "#009E73",
               "sham": "#CC79A7"}
#: Legend keys that are not layers (PR_Q solid, PR_K dashed): a colour no layer has.
KEY_COLOR = "black"
# Okabe–Ito without its yellow (1.3:1 on white), black and grey (the legend keys' and
# the reference lines' colours), the four of highest contrast first, so shallow models get
# those; then Tol's muted wine and olive (the deepest layers of an 8-layer model).
LAYER_PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9",
                 "#882255", "#999933")
#: More layers than the palette: plasma from its dark end to here (above, it is too pale
#: on white: contrast < 2.4:1); plasma has no grey, unlike cividis' middle.
PLASMA_TOP = 0.75

#: Seeds from which a 95 % t-band is drawn instead of one thin line per seed.
BAND_MIN_UNITS = 5
SEED_LINEWIDTH = 0.6  # the thin line of one seed beside the mean


def layer_colors(n: int) -> list[Any]:
    """``n`` colours for layers 0 … n−1: :data:`LAYER_PALETTE` up to 8 layers, so each
    layer can be named from the legend; beyond that plasma from dark to
    :data:`PLASMA_TOP` (ordered by depth, perceptually uniform, no pale end)."""
    if n <= len(LAYER_PALETTE):
        return list(LAYER_PALETTE[:max(n, 0)])
    import matplotlib

    return list(matplotlib.colormaps["plasma"](np.linspace(0.0, PLASMA_TOP, n)))


def mode_color(arm: str) -> str:
    """The colour of a key-control mode or of an arm named after it (``shrink-0.5-token-data``);
    grey for one without its own."""
    return MODE_COLORS.get(arm.split("-", 1)[0], "0.6")


def _unit_matrix(per_unit: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values): one row per unit, one column per step, NaN where a unit has no
    finite value at a step."""
    steps, si = np.unique(per_unit["step"].to_numpy(dtype=float), return_inverse=True)
    _, ui = np.unique(per_unit["unit"].astype(str).to_numpy(), return_inverse=True)
    values = np.full((int(ui.max()) + 1 if len(ui) else 0, len(steps)), np.nan)
    values[ui, si] = per_unit["value"].to_numpy(dtype=float)
    values[~np.isfinite(values)] = np.nan
    return steps, values


def draw_spread(ax: Axes, per_unit: pd.DataFrame, color: Any, *, linestyle: str = "-",
                label: str | None = None, **kw: Any) -> bool:
    """The mean over units (seeds) of ``per_unit`` (columns ``unit``, ``step``, ``value``)
    against step, and its spread: a 95 % t-band when there are at least
    :data:`BAND_MIN_UNITS` units, else one thin line per unit (none for a single unit).
    Returns True when a band was drawn. ``kw`` goes to the mean's line (markers)."""
    steps, values = _unit_matrix(per_unit)
    seen = np.isfinite(values)
    units, drawn = seen.any(axis=1), seen.any(axis=0)
    steps, values, seen = steps[drawn], values[units][:, drawn], seen[units][:, drawn]
    if not len(steps):
        return False
    mean = np.nanmean(values, axis=0)
    ax.plot(steps, mean, color=color, linestyle=linestyle, label=label, **kw)
    if len(values) >= BAND_MIN_UNITS:
        bounds = np.array([t_interval(column[np.isfinite(column)])[1:3]
                           for column in values.T])
        ax.fill_between(steps, bounds[:, 0], bounds[:, 1], color=color, alpha=0.13,
                        linewidth=0)
        return True
    if len(values) > 1:  # one artist for all the seeds: far cheaper than a line each
        from matplotlib.collections import LineCollection

        seeds = [np.column_stack([steps[ok], row[ok]]) for row, ok in zip(values, seen,
                                                                            strict=True)]
        ax.add_collection(LineCollection(seeds, colors=[color], linestyles=linestyle,
                                         linewidths=SEED_LINEWIDTH, alpha=0.45))
    return False


def spread_note(counts: Iterable[int], unit: str = "seed") -> str:
    """How the figures of panels with ``counts`` units each show the spread (the caption's
    words for :func:`draw_spread`; "95 %" joined by a no-break space, so a wrapped title
    never splits it)."""
    counts = sorted({int(c) for c in counts if c > 0})
    if not counts:
        return ""
    if counts[-1] == 1:
        return f"one {unit} per panel: its own line, no spread"
    span = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    if counts[0] >= BAND_MIN_UNITS:
        return f"{unit} mean ± 95\u00a0% t-interval over {unit}s (n = {span})"
    few = (f"{unit} mean (thick) and each {unit} (thin), n = {span}: no interval below "
           f"{BAND_MIN_UNITS} {unit}s (with 2 a 95\u00a0% t-interval is ±12.7 standard "
           "errors)")
    if counts[-1] >= BAND_MIN_UNITS:
        return few + f"; panels with ≥ {BAND_MIN_UNITS} {unit}s show the t-interval instead"
    return few


def new_figure(width: float, height: float) -> Figure:
    """A bare constrained-layout Figure (no pyplot): no global backend switch, no figure
    registry to leak or close."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def grid(n_rows: int, n_cols: int, height: float = PANEL_H, legend: bool = False,
         **kw: Any) -> tuple[Figure, np.ndarray]:
    """A figure of ``n_rows`` × ``n_cols`` panels (``legend``: with :data:`LEGEND_W`
    inches beside them for a legend); axes as a 2-D array."""
    fig = new_figure(PANEL_W * n_cols + (LEGEND_W if legend else 0.0), height * n_rows)
    return fig, fig.subplots(n_rows, n_cols, squeeze=False, **kw)


#: Average width of a character of the title, in ems (DejaVu Sans, mixed text; generous,
#: so a wrapped line never reaches the edges).
_CHAR_EM = 0.58


def suptitle(fig: Figure, text: str) -> None:
    """A figure title wrapped to the figure's width (a longer line would be cut at the
    figure's edges); the figure grows by the title's height, so its panels keep theirs."""
    chars = int(fig.get_figwidth() * 72 / (TITLE_PT * _CHAR_EM))
    wrapped = textwrap.fill(text, width=max(chars, 20))
    fig.suptitle(wrapped, fontsize=TITLE_PT)
    lines = wrapped.count("\n") + 1
    fig.set_figheight(fig.get_figheight() + lines * TITLE_PT * 1.25 / 72)


def blank_panel(ax: Axes, text: str) -> None:
    """A panel with nothing to plot: ``text`` in its middle (why), no ticks, no frame (the
    ticks of an axis shared with other panels stay: clearing them would clear theirs)."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    if len(ax.get_shared_x_axes().get_siblings(ax)) == 1:
        ax.set_xticks([])
    if len(ax.get_shared_y_axes().get_siblings(ax)) == 1:
        ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)


def step_axis(ax: Axes, max_step: float) -> None:
    """At most ~5 step ticks; thousands as "5k" once runs are long (no colliding labels)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
    if max_step >= 10_000:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k" if x else "0"))


def save_figure(fig: Figure, out_dir: str | Path, name: str,
                dpi: int = SCREEN_DPI) -> list[Path]:
    """Write ``name.png`` (``dpi``) and ``name.svg`` atomically; returns both paths.

    The costly constrained layout runs once, then the engine is removed, so neither file
    lays out again and both show the same panel positions."""
    import matplotlib

    out_dir = Path(out_dir)
    paths = []
    with matplotlib.rc_context(STYLE):
        engine = fig.get_layout_engine()
        if engine is not None and fig.axes:
            engine.execute(fig)  # what a draw does first, without the draw itself
        fig.set_layout_engine(None)  # positions stay; None = no further layout passes
        for fmt in ("png", "svg"):
            path = out_dir / f"{name}.{fmt}"
            atomic_write(path, lambda p, fmt=fmt: fig.savefig(p, format=fmt, dpi=dpi))
            paths.append(path)
    return paths
