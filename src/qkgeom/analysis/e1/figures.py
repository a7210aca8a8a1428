"""Figures of E1/E2 from a collated sweep table (matplotlib; PNG 300 dpi + SVG).

One panel per depth × Q/K initialisation in the house style of :mod:`qkgeom.analysis.kit`
(a paper column per panel, 8 pt text, layers on a truncated viridis ramp, the contrast on
the diverging RdBu map centred at 0), and a dashed vertical line at the post-transient
reference step. Each figure exists at the weight and at the token level:

- ``pr_<level>``: PR_Q and PR_K against step, seed mean ± 95 % t-interval, one line per layer;
- ``contrast_<level>``: PR_Q − PR_K per layer as a layer × step heatmap;
- ``qk_entropy_<level>``: the interaction PR (pr_qk) and the attention entropy against step;
- ``heads_<level>``: pr_qk against attention entropy for every head of every run, coloured
  by training step.

A figure whose metrics the runs do not record (e.g. a monitored run that measured only some)
is not drawn: :func:`missing_for` names what it lacks and the report says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import Normalize, TwoSlopeNorm
from matplotlib.figure import Figure

from qkgeom.analysis.collate import trajectories
from qkgeom.analysis.e1.trajectories import LEVELS, reference_probe
from qkgeom.analysis.kit import (
    PANEL_H,
    REF_LINE,
    STYLE,
    grid,
    layer_colors,
    missing_metrics,
    save_figure,
    step_axis,
    suptitle,
)

LEVEL_TITLE = {"weight": "weight level", "token": "token level (probe set)"}

def _settings(table: pd.DataFrame) -> tuple[list[int], list[tuple[str, str]]]:
    depths = sorted(int(d) for d in table["depth"].unique())
    cols = sorted({(str(i), str(v)) for i, v in zip(table["qk_init"], table["variant"], strict=True)})
    return depths, cols


def _label(init: str, variant: str) -> str:
    return init if not variant else f"{init} · {variant}"


def _ref_steps(table: pd.DataFrame) -> dict[str, int]:
    return {r["run_id"]: int(r["ref_step"]) for r in table.attrs.get("runs", [])
            if r.get("ref_step") is not None}


def _group_ref(table: pd.DataFrame, sub: pd.DataFrame) -> int | None:
    """The reference probe of one (depth, init) group: first probed step ≥ its ref_step."""
    refs = _ref_steps(table)
    known = [refs[r] for r in sub["run_id"].unique() if r in refs]
    if not known or sub.empty:
        return None
    return reference_probe(sub["step"].unique(), min(known))


def _empty(ax: Axes) -> None:
    """A panel of the grid with no analysed run (e.g. every seed of it diverged)."""
    ax.text(0.5, 0.5, "no runs", ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)


def _lines(ax: Axes, traj: pd.DataFrame, colors: np.ndarray, layers: list[int]) -> None:
    for color, layer in zip(colors, layers, strict=True):
        t = traj[traj["layer"] == layer]
        ax.plot(t["step"], t["mean"], color=color, label=f"{layer}")
        if t["ci_low"].notna().any():
            ax.fill_between(t["step"], t["ci_low"], t["ci_high"], color=color, alpha=0.15,
                            linewidth=0)


def _data_range(traj: pd.DataFrame, means_only: bool = False) -> tuple[float, float]:
    cols = [traj["mean"]] if means_only else [traj["mean"], traj["ci_low"], traj["ci_high"]]
    vals = pd.concat(cols).to_numpy(dtype=float)
    vals = vals[np.isfinite(vals)]
    return (float(vals.min()), float(vals.max())) if len(vals) else (np.nan, np.nan)


def _share_ylim(axes: list[Axes], ranges: list[tuple[float, float]], log: bool = False) -> None:
    """One y range for ``axes`` from the given data ranges, floored at 0: every quantity
    plotted (PR, entropy) is non-negative. CI bands outside the range are clipped.

    ``log``: a log axis over the seed means only (participation ratios are >= 1 and span the
    early transient's tens of dimensions and the later few); CI bands are clipped to it."""
    finite = [r for r in ranges if np.isfinite(r[0])]
    if not finite:
        return
    lo, hi = min(r[0] for r in finite), max(r[1] for r in finite)
    if log:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        for ax in axes:
            ax.set_yscale("log")
            ax.set_ylim(max(lo, 0.5) / 1.15, hi * 1.15)
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 2, 5, 10
            ax.yaxis.set_minor_formatter(NullFormatter())
        return
    pad = 0.15 * (hi - lo) if hi > lo else 0.05 * max(abs(hi), 1.0)
    for ax in axes:
        ax.set_ylim(max(lo - pad, 0.0), hi + pad)


def _paired_rows(table: pd.DataFrame, level: str, metrics: list[tuple[str, str]],
                 title: str, share_depth: bool, log_metrics: tuple[str, ...] = ()) -> Figure:
    """Rows = depth × the given metrics, columns = Q/K init; one line per layer. The y axis
    is shared along each row, and across all rows of a depth when ``share_depth``; rows of
    ``log_metrics`` get a log y axis."""
    depths, cols = _settings(table)
    n_rows = len(depths) * len(metrics)
    fig, axes = grid(n_rows, len(cols))
    trajs = {m: trajectories(table, m) for m, _ in metrics}
    for di, depth in enumerate(depths):
        shared: dict[int, tuple[list[Axes], list[tuple[float, float]]]] = {}
        legend_ax, legend_col = None, -1
        for r, (metric, ylabel) in enumerate(metrics):
            row = di * len(metrics) + r
            axs, ranges = shared.setdefault(0 if share_depth else r, ([], []))
            for c, (init, variant) in enumerate(cols):
                ax = axes[row, c]
                ax.set_title(f"depth {depth} · {_label(init, variant)}")
                if c == 0:
                    ax.set_ylabel(ylabel)
                if row == n_rows - 1:
                    ax.set_xlabel("training step")
                tr = trajs[metric]
                tr = tr[(tr["depth"] == depth) & (tr["qk_init"] == init)
                        & (tr["variant"] == variant)]
                if tr.empty:
                    _empty(ax)
                    continue
                layers = sorted(int(x) for x in tr["layer"].unique())
                _lines(ax, tr, layer_colors(len(layers)), layers)
                step_axis(ax, float(tr["step"].max()))
                axs.append(ax)
                # Axes follow the seed means; a 2-seed t-interval (x12.7 the s.e.) would
                # otherwise stretch them far past the data (and past log T for entropy).
                ranges.append(_data_range(tr, means_only=True))
                sel = (table["depth"] == depth) & (table["qk_init"] == init) & \
                    (table["variant"] == variant)
                ref = _group_ref(table, table[sel])
                if ref is not None:
                    ax.axvline(ref, **REF_LINE)
                ax.margins(x=0.01)
                if r == 0:
                    legend_ax, legend_col = ax, c  # last drawn panel of the depth's first row
        if legend_ax is not None:
            n_layers = len(legend_ax.get_legend_handles_labels()[0])
            where = ({"loc": "center left", "bbox_to_anchor": (1.0, 0.5)}
                     if legend_col == len(cols) - 1 else {"loc": "best"})  # never over a panel
            legend_ax.legend(title="layer", frameon=False, ncols=1 + n_layers // 10, **where)
        for key, (axs, ranges) in shared.items():
            row_metric = metrics[0][0] if share_depth else metrics[key][0]
            _share_ylim(axs, ranges, log=row_metric in log_metrics)
    suptitle(fig, f"{title} — {LEVEL_TITLE[level]}; seed mean ± 95 % CI; "
              "dashed line: reference step", len(cols))
    return fig


def fig_pr(table: pd.DataFrame, level: str = "weight") -> Figure:
    """(a) PR_Q and PR_K against step per depth × init, one line per layer."""
    with matplotlib.rc_context(STYLE):
        return _paired_rows(table, level, [(f"pr_q_{level}", "PR_Q (dimensions)"),
                                           (f"pr_k_{level}", "PR_K (dimensions)")],
                            "Participation ratio of queries and keys", share_depth=True,
                            log_metrics=(f"pr_q_{level}", f"pr_k_{level}"))


def fig_qk_entropy(table: pd.DataFrame, level: str = "weight") -> Figure:
    """(c) Interaction PR (pr_qk) and attention entropy against step."""
    with matplotlib.rc_context(STYLE):
        return _paired_rows(table, level, [(f"pr_qk_{level}", "PR of QKᵀ spectrum (dims)"),
                                           ("attn_entropy", "attention entropy (nats)")],
                            "Interaction spectrum and attention entropy", share_depth=False,
                            log_metrics=(f"pr_qk_{level}",))


def fig_contrast(table: pd.DataFrame, level: str = "weight") -> Figure:
    """(b) PR_Q − PR_K per layer × step (seed mean), diverging colours centred at 0."""
    with matplotlib.rc_context(STYLE):
        depths, cols = _settings(table)
        tr = trajectories(table, f"contrast_{level}")
        fig, axes = grid(len(depths), len(cols), height=max(1.7, 2.6 / len(depths)))
        vmax = float(np.nanmax(np.abs(tr["mean"]))) if len(tr) else 1.0
        vmax = vmax if np.isfinite(vmax) and vmax > 0 else 1.0
        norm = TwoSlopeNorm(vcenter=0.0, vmin=-vmax, vmax=vmax)
        mesh = None
        for r, depth in enumerate(depths):
            for c, (init, variant) in enumerate(cols):
                ax = axes[r, c]
                t = tr[(tr["depth"] == depth) & (tr["qk_init"] == init) & (tr["variant"] == variant)]
                ax.set_title(f"depth {depth} · {_label(init, variant)}")
                if t.empty:
                    _empty(ax)
                    continue
                cells = t.pivot_table(index="layer", columns="step", values="mean")
                steps = cells.columns.to_numpy(dtype=float)
                layers = cells.index.to_numpy()
                mesh = ax.pcolormesh(_edges(steps), np.arange(len(layers) + 1) - 0.5,
                                     cells.to_numpy(), cmap="RdBu_r", norm=norm,
                                     shading="flat", rasterized=True)
                ax.set_yticks(np.arange(len(layers)), [str(x) for x in layers])
                step_axis(ax, float(steps.max()))
                ax.set_ylim(len(layers) - 0.5, -0.5)  # layer 0 on top
                sel = (table["depth"] == depth) & (table["qk_init"] == init) & \
                    (table["variant"] == variant)
                ref = _group_ref(table, table[sel])
                if ref is not None:
                    ax.axvline(ref, color="k", linestyle="--", linewidth=0.8)
                if c == 0:
                    ax.set_ylabel("layer")
                if r == len(depths) - 1:
                    ax.set_xlabel("training step")
                for side in ("top", "right"):
                    ax.spines[side].set_visible(True)
        return _finish(fig, axes, mesh, "PR_Q − PR_K (dims)",
                       f"Paired contrast PR_Q − PR_K — {LEVEL_TITLE[level]}; seed mean; "
                       "red: queries higher-dimensional; dashed: reference step")


def _finish(fig: Figure, axes: np.ndarray, mappable: Any, label: str, title: str) -> Figure:
    """The colour bar of ``mappable`` (None: no panel drew one) beside ``axes``, and the
    figure title."""
    if mappable is not None:
        cb = fig.colorbar(mappable, ax=axes, shrink=0.8, aspect=30, pad=0.01)
        cb.set_label(label)
    suptitle(fig, title, axes.shape[1])
    return fig


def _edges(steps: np.ndarray) -> np.ndarray:
    """Cell edges around (possibly unevenly spaced) probe steps."""
    if len(steps) == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    mid = (steps[1:] + steps[:-1]) / 2
    return np.concatenate([[steps[0] - (mid[0] - steps[0])], mid,
                           [steps[-1] + (steps[-1] - mid[-1])]])


def fig_heads(table: pd.DataFrame, level: str = "weight") -> Figure:
    """(d) pr_qk vs attention entropy for every head of every run, coloured by step."""
    with matplotlib.rc_context(STYLE):
        depths, cols = _settings(table)
        heads = table[(table["head"] >= 0)
                      & table["metric"].isin([f"pr_qk_{level}", "attn_entropy"])]
        wide = heads.pivot_table(index=["depth", "qk_init", "variant", "run_id", "layer",
                                        "head", "step"], columns="metric",
                                 values="value").reset_index()
        fig, axes = grid(len(depths), len(cols), height=max(PANEL_H, 2.6 / len(depths)))
        smax = float(table["step"].max()) if len(table) else 1.0
        norm = Normalize(vmin=0.0, vmax=max(smax, 1.0))
        sc = None
        for r, depth in enumerate(depths):
            for c, (init, variant) in enumerate(cols):
                ax = axes[r, c]
                ax.set_title(f"depth {depth} · {_label(init, variant)}")
                if f"pr_qk_{level}" not in wide or "attn_entropy" not in wide:
                    continue
                w = wide[(wide["depth"] == depth) & (wide["qk_init"] == init)
                         & (wide["variant"] == variant)].sort_values("step")
                if w.empty:
                    _empty(ax)
                    continue
                dense = len(w) > 3000  # many heads x runs x probes: smaller, lighter dots
                sc = ax.scatter(w[f"pr_qk_{level}"], w["attn_entropy"], c=w["step"],
                                cmap="viridis", norm=norm, s=2.5 if dense else 5,
                                alpha=0.5 if dense else 0.7, linewidths=0, rasterized=True)
                if c == 0:
                    ax.set_ylabel("attention entropy (nats)")
                if r == len(depths) - 1:
                    ax.set_xlabel("PR of QKᵀ spectrum (dimensions)")
        return _finish(fig, axes, sc, "training step",
                       f"Heads: interaction PR vs attention entropy — {LEVEL_TITLE[level]}; "
                       "one point per head, run and probe step")


FIGURES: dict[str, Callable[[pd.DataFrame, str], Figure]] = {
    "pr": fig_pr, "contrast": fig_contrast, "qk_entropy": fig_qk_entropy, "heads": fig_heads,
}


def figure_metrics(kind: str, level: str) -> tuple[str, ...]:
    """The metrics figure ``kind`` plots at ``level`` (the heads figure: per head)."""
    return {"pr": (f"pr_q_{level}", f"pr_k_{level}"), "contrast": (f"contrast_{level}",),
            "qk_entropy": (f"pr_qk_{level}", "attn_entropy"),
            "heads": (f"pr_qk_{level}", "attn_entropy")}[kind]


def missing_for(table: pd.DataFrame, kind: str, level: str) -> list[str]:
    """The metrics figure ``kind`` needs at ``level`` that ``table`` does not record."""
    rows = table[table["head"] >= 0] if kind == "heads" else table
    return missing_metrics(rows, figure_metrics(kind, level))


def make_figures(table: pd.DataFrame, out_dir: str | Path,
                 levels: Iterable[str] = LEVELS,
                 kinds: Iterable[str] = tuple(FIGURES)) -> dict[str, Path]:
    """Every figure at every level into ``out_dir``; returns {``kind_level``: PNG path}.
    A figure whose metrics the table does not record is not drawn (:func:`missing_for`)."""
    out = {}
    for kind in kinds:
        for level in levels:
            if missing_for(table, kind, level):
                continue
            name = f"{kind}_{level}"
            out[name] = save_figure(FIGURES[kind](table, level), out_dir, name)[0]
    return out
