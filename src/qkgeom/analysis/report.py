"""The sweep report: claims table first, then setup, excluded runs, figures, statistics.

``write_report(sweep_dir)`` writes ``<sweep>/report/`` (SPEC §7): ``report.md`` (opens with
the claims table), a self-contained ``report.html`` (figures embedded), the figures as PNG
(300 dpi) and SVG, and the numbers behind the table as CSV (``claims.csv``,
``trajectory_stats.csv``, ``trajectory_stats_runs.csv``, ``bootstrap.csv``). An E3 sweep gets
its own report (:mod:`qkgeom.analysis.report_e3`). Every file is written atomically. Nothing here imports torch; matplotlib is imported only to draw.
"""

from __future__ import annotations

import base64
import html
import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.claims import evaluate_claims
from qkgeom.analysis.collate import collate, excluded_runs, runs_of, sweep_axes
from qkgeom.analysis.e3 import e3_analysis, is_e3
from qkgeom.errors import QKGeomError
from qkgeom.io import atomic_write
from qkgeom.runs.family import is_analysis_folder


def claims_table(sweep_dir: str | Path, n_boot: int = stats.N_BOOT,
                 rng_seed: int = stats.BOOT_SEED,
                 include_incomplete: bool = False) -> pd.DataFrame:
    """The claims table of any result folder: a sweep (E1/E2 or E3), one run folder, or a
    checkpoint analysis folder (E4)."""
    if is_analysis_folder(sweep_dir):
        from qkgeom.analysis.e4.report import e4_claims_table

        return e4_claims_table(sweep_dir)
    return _sweep_claims(sweep_dir, n_boot, rng_seed, include_incomplete)


def _sweep_claims(sweep_dir: str | Path, n_boot: int, rng_seed: int,
                  include_incomplete: bool) -> pd.DataFrame:
    """The claims table of a sweep folder (see :func:`qkgeom.analysis.claims.evaluate_claims`;
    for an E3 sweep, :func:`qkgeom.analysis.e3.evaluate_e3_claims`): one row per claim × level
    × origin with the count, mean and seed-bootstrap CI, the
    sign-test p-value and the verdict. ``table.attrs["excluded"]`` lists runs left out."""
    table = collate(sweep_dir, include_incomplete=include_incomplete)
    if is_e3(table):
        claims = e3_analysis(table, n_boot, rng_seed)["claims"]
    else:
        claims = _claims(table, n_boot, rng_seed)[0]
    claims.attrs["excluded"] = table.attrs["excluded"]
    return claims


def _claims(table: pd.DataFrame, n_boot: int,
            rng_seed: int) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    if table.empty:
        empty = pd.DataFrame()
        return evaluate_claims(empty), empty, empty
    traj = stats.trajectory_stats(table)
    boot = stats.bootstrap_ci(table, n_boot=n_boot, rng_seed=rng_seed)
    return evaluate_claims(traj, boot), traj, boot


# ---------------------------------------------------------------------------------------
# Markdown pieces
# ---------------------------------------------------------------------------------------

def _md_table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def _p(p: float) -> str:
    if not np.isfinite(p):
        return "n/a"
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}"


def claims_markdown(claims: pd.DataFrame) -> str:
    """The claims table as Markdown (one row per claim × level × origin)."""
    rows = []
    for r in claims.to_dict("records"):
        rows.append([r["claim_id"], r["claim"], r["level"], r["from"], r["measured"],
                     r["estimate"], "sign test", _p(r["p_value"]), f"**{r['verdict']}**"])
    return _md_table(["id", "claim", "level", "measured from", "measured (k/n)",
                      "estimate [95 % seed-bootstrap CI]", "test", "p (one-sided)", "verdict"],
                     rows)


def _rules_text() -> str:
    return (
        f"Verdicts are computed by `qkgeom.analysis.stats.verdict`: **supported** = the predicted sign "
        f"in ≥ {stats.SUPPORT_SHARE:.0%} of trajectories (in all of them for E1.3, a claim "
        f"about *all* trajectories) and exact one-sided sign-test p < {stats.ALPHA}; "
        f"**not supported** = the predicted sign in ≤ {stats.FAIL_SHARE:.0%}; **mixed** "
        "otherwise. A zero counts against the claim. Each row says which origin it measures "
        "from: *step 0*, or the post-transient *reference* (first probe at or after the end "
        "of LR warm-up, or the configured `reference_step`; SPEC §2). The bootstrap resamples "
        f"seeds with replacement within each depth × init ({stats.N_BOOT} resamples, fixed "
        "RNG seed) and recomputes the mean over trajectories. Layers of one run are not "
        "independent, so the sign test's p treats trajectories as more independent than they "
        "are; read it together with the seed-bootstrap CI."
    )


def _n_params(r: pd.Series) -> int:
    d, L = int(r["n_embd"]), int(r["depth"])
    per_layer = 12 * d * d + 2 * d + (11 * d if r.get("bias") else 0)
    return L * per_layer + int(r["vocab_size"]) * d + int(r["block_size"]) * d + d * (
        2 if r.get("bias") else 1)


def _range(values: pd.Series, fmt: str = "{}") -> str:
    vals = sorted({v for v in values.dropna().tolist()}, key=lambda v: (str(type(v)), v))
    if not vals:
        return "n/a"
    return ", ".join(fmt.format(v) for v in vals)


def _duration(seconds: float) -> str:
    if not np.isfinite(seconds):
        return "n/a"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def setup_markdown(table: pd.DataFrame, sweep_dir: Path, traj: pd.DataFrame,
                   trajectories: bool = True) -> str:
    """Grid, data, model sizes, tokens, seeds, reference steps and wall time.
    ``trajectories=False`` (E3, whose unit is the seed) leaves out the E1 trajectory
    count and the reference probe used by the E1/E2 statistics."""
    runs = runs_of(table)
    spec = table.attrs.get("sweep") or {}
    inc = runs[runs["excluded"] == ""] if len(runs) else runs
    lines = ["## Setup", ""]
    name = table.attrs.get("name") or sweep_dir.name
    lines.append(f"- **Sweep**: `{name}` ({sweep_dir}); {len(runs)} runs, {len(inc)} analysed, "
                 f"{len(runs) - len(inc)} excluded (below).")
    axes = sweep_axes(spec)
    if axes:
        grid = spec.get("grid", {})
        preset = f" on preset `{grid['preset']}`" if grid.get("preset") else ""
        lines.append(f"- **Grid** (sweep.json){preset}: " + "; ".join(
            f"`{k}` ∈ {{{', '.join(map(str, v))}}}" for k, v in axes.items()))
    if len(inc):
        lines.append(f"- **Depths** (n_layer): {_range(inc['depth'])}; **Q/K inits**: "
                     f"{_range(inc['qk_init'])}; **seeds**: {_range(inc['seed'])}")
        per = inc.groupby(["depth", "qk_init", "variant"])["seed"].nunique()
        if trajectories:
            lines.append(f"- **Seeds per depth × init**: {per.min()}–{per.max()}; "
                         f"**trajectories** (depth × init × layer): "
                         f"{int(inc.drop_duplicates(['depth', 'qk_init', 'variant'])['depth'].sum())}")
        variants = [v for v in inc["variant"].unique() if v]
        if variants:
            lines.append(f"- **Other varying settings** (kept apart): {', '.join(variants)}")
        lines.append(f"- **Data**: {_range(inc['data_source'])}; vocabulary "
                     f"{_range(inc['vocab_size'])} characters")
        sizes = inc.drop_duplicates("depth").sort_values("depth")
        lines.append("- **Models**: " + "; ".join(
            f"depth {int(r.depth)}: {int(r.n_head)} heads, d_model {int(r.n_embd)}, context "
            f"{int(r.block_size)}, {_n_params(pd.Series(r._asdict())) / 1e6:.2f} M parameters"
            for r in sizes.itertuples()))
        tokens = inc["tokens"]
        lines.append(f"- **Training**: {_range(inc['steps'])} steps × batch "
                     f"{_range(inc['batch_size'])} × {_range(inc['block_size'])} tokens = "
                     f"{_range(tokens, '{:,}')} tokens per run; peak lr {_range(inc['lr'])}; "
                     f"LR warm-up {_range(inc['warmup_steps'])} steps")
        ref_used = (sorted(traj.loc[traj["origin"] == "reference", "start_step"].unique())
                    if len(traj) else [])
        if trajectories:
            lines.append(f"- **Reference step** (configured): {_range(inc['ref_step'])}; first "
                         f"probe at or after it (used): {', '.join(map(str, ref_used)) or 'n/a'}")
        lines.append(f"- **Probes**: every {_range(inc['probe_every'])} steps plus step 0 and the "
                     f"last, on {_range(inc['probe_sequences'])} held-out sequences × context")
        if "train_seconds" in inc and inc["train_seconds"].notna().any():
            ts = inc["train_seconds"].dropna()
            lines.append(f"- **Wall time** (training steps, from train_log throughput; probes "
                         f"and evals not counted): median {_duration(float(ts.median()))} per "
                         f"run, {_duration(float(ts.sum()))} in all")
        if "final_val_loss" in inc and inc["final_val_loss"].notna().any():
            vl = inc.groupby(["depth", "qk_init", "variant"])["final_val_loss"].agg(["mean", "std"])
            lines += ["", "Final validation loss (nats/char), mean ± sd over seeds:", ""]
            lines.append(_md_table(
                ["depth", "qk_init", *(["variant"] if variants else []), "val loss"],
                [[d, i, *([v] if variants else []),
                  f"{m:.3f}" + (f" ± {s:.3f}" if np.isfinite(s) else "")]
                 for (d, i, v), (m, s) in vl.iterrows()]))
    return "\n".join(lines)


def excluded_markdown(table: pd.DataFrame) -> str:
    ex = excluded_runs(table)
    lines = ["## Excluded runs", ""]
    if ex.empty:
        lines.append("None: every run of the sweep finished and is in the averages.")
        return "\n".join(lines)
    lines.append(f"{len(ex)} run(s) are left out of every average, count and figure:")
    lines.append("")
    lines.append(_md_table(["run", "depth", "qk_init", "seed", "state", "reason"],
                           [[f"`{r.run_id}`", r.depth, r.qk_init, r.seed, r.state, r.excluded]
                            for r in ex.itertuples()]))
    return "\n".join(lines)


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


def report_markdown(table: pd.DataFrame, claims: pd.DataFrame, traj: pd.DataFrame,
                    figures: dict[str, Path], sweep_dir: Path) -> str:
    name = table.attrs.get("name") or sweep_dir.name
    parts = [f"# qkgeom report: {name}", "", claims_markdown(claims), "",
             _rules_text(), ""]
    caveats = _caveats(traj)
    if caveats:
        parts += [*caveats, ""]
    parts += ["Claims: SPEC §1 (E1, E2). Per-trajectory numbers: `trajectory_stats.csv` "
              "(seed-averaged) and `trajectory_stats_runs.csv` (per run); CIs: `bootstrap.csv`; "
              "this table: `claims.csv`.", ""]
    parts += [setup_markdown(table, sweep_dir, traj), "", excluded_markdown(table), ""]
    from qkgeom.analysis.figures import CAPTIONS, FIGURE_TITLES

    parts += ["## Figures", ""]
    if not figures:
        parts.append("No figures: no run could be analysed.")
    for key, png in figures.items():
        kind, level = key.rsplit("_", 1)
        parts += [f"### {FIGURE_TITLES[kind]} — {level} level", "",
                  f"[![{key}]({png.name})]({png.name})", "",
                  f"*{CAPTIONS[kind]} {level.capitalize()} level. Vector version: "
                  f"[{png.with_suffix('.svg').name}]({png.with_suffix('.svg').name}).*", ""]
    return "\n".join(parts).rstrip() + "\n"


# ---------------------------------------------------------------------------------------
# HTML
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


def render_html(markdown_text: str, folder: Path, title: str) -> str:
    """Markdown → standalone HTML; every local PNG is embedded (as a data URI, at most
    1400 px wide) and links to its full-resolution file."""
    try:
        import markdown
    except ImportError as err:  # declared dependency; a clear message if it is missing
        raise ImportError("report.html needs the 'markdown' package: pip install markdown") from err
    body = markdown.markdown(markdown_text, extensions=["tables"])

    def embed(match: re.Match[str]) -> str:
        head, src = match.group(1), match.group(2)
        path = folder / src
        if src.endswith(".png") and path.exists():
            data = base64.b64encode(_web_png(path)).decode("ascii")
            return f'{head}src="data:image/png;base64,{data}"'
        return match.group(0)

    body = re.sub(r'(<img [^>]*?)src="([^"]+)"', embed, body)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n"
            f"<body>\n{body}\n</body></html>\n")


def write_report(sweep_dir: str | Path, out: str | Path | None = None,
                 n_boot: int = stats.N_BOOT, rng_seed: int = stats.BOOT_SEED,
                 include_incomplete: bool = False, figures: bool = True) -> Path:
    """Analyse a sweep folder and write its report; returns the path of ``report.md``.

    ``out`` defaults to ``<sweep_dir>/report``. Diverged, failed and unfinished runs are
    left out of every number and listed with their reason (``include_incomplete`` keeps
    runs still running). An E3 sweep (key control paired by seed) gets the E3 report
    (:mod:`qkgeom.analysis.report_e3`). ``figures=False`` skips the figures (faster; tables only).
    """
    sweep_dir = Path(sweep_dir)
    if is_analysis_folder(sweep_dir):  # a checkpoint family (qkgeom analyze): E4
        from qkgeom.analysis.e4.report import write_e4_report

        return write_e4_report(sweep_dir, out, figures=figures)
    if not sweep_dir.is_dir():
        raise QKGeomError(f"{sweep_dir}: no such folder")
    out = sweep_dir / "report" if out is None else Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = collate(sweep_dir, include_incomplete=include_incomplete)
    if is_e3(table):  # runs with and without key control, paired by seed
        from qkgeom.analysis.report_e3 import write_e3_report

        return write_e3_report(table, sweep_dir, out, n_boot, rng_seed, figures)
    claims, traj, boot = _claims(table, n_boot, rng_seed)
    runs_traj = stats.trajectory_stats(table, by="run") if not table.empty else pd.DataFrame()
    for name, frame in (("claims", claims), ("trajectory_stats", traj),
                        ("trajectory_stats_runs", runs_traj), ("bootstrap", boot)):
        atomic_write(out / f"{name}.csv", lambda p, f=frame: f.to_csv(p, index=False))
    figs = {}
    if figures and not table.empty:
        from qkgeom.analysis.figures import make_figures  # matplotlib only when drawing

        figs = make_figures(table, out)
    text = report_markdown(table, claims, traj, figs, sweep_dir)
    return write_pages(out, text, table.attrs.get("name") or sweep_dir.name)


def write_pages(out: Path, text: str, title: str) -> Path:
    """``report.md`` and its self-contained ``report.html`` into ``out``, atomically;
    returns the path of ``report.md``."""
    md_path = out / "report.md"
    atomic_write(md_path, lambda p: p.write_text(text, encoding="utf-8"))
    page = render_html(text, out, f"qkgeom report: {title}")
    atomic_write(out / "report.html", lambda p: p.write_text(page, encoding="utf-8"))
    return md_path
