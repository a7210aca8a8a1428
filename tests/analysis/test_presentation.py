"""How reports show their results: the summary line, the grouped claims table, coloured
verdicts, seeds as lines or bands, the last-probe heads figure, degenerate E4 figures left
out with a note, checkpoint labels, figure files (PNG at screen dpi + SVG) and a page that
links its large figures instead of embedding them."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.colors import to_rgb
from PIL import Image

from qkgeom.analysis import collate, summary_line, write_report
from qkgeom.analysis.e1.figures import fig_contrast, fig_heads, fig_pr
from qkgeom.analysis.e4.figures import fig_heads as e4_fig_heads
from qkgeom.analysis.e4.labels import checkpoint_label
from qkgeom.analysis.figstyle import (
    BAND_MIN_UNITS,
    PANEL_W,
    SCREEN_DPI,
    SEED_LINEWIDTH,
    grid,
    layer_colors,
    save_figure,
    spread_note,
)
from qkgeom.analysis.kit import (
    EMBED_MAX_BYTES,
    claims_markdown,
    claims_summary,
    render_html,
    verdict_class,
)
from qkgeom.errors import QKGeomError

from .conftest import make_sweep, monotone_values, write_analysis, write_run

# ---------------------------------------------------------------------------------------
# The claims table: summary line, groups, verdict colours
# ---------------------------------------------------------------------------------------


def _claims() -> pd.DataFrame:
    """Seven rows of three claims with every verdict: 3 supported, 1 mixed, 2 not
    supported, 1 not evaluated."""
    rows = [("E1.1", "PR_Q expands", "weight", "step0", "supported"),
            ("E1.1", "PR_Q expands", "weight", "reference", "supported"),
            ("E1.1", "PR_Q expands", "token", "step0", "mixed"),
            ("E1.2", "PR_K shrinks", "weight", "step0", "not supported"),
            ("E1.2", "PR_K shrinks", "token", "step0", "supported"),
            ("E2.3", "Across heads, sharper", "weight", "last", "not supported"),
            ("E2.3", "Across heads, sharper", "token", "last", "not evaluated")]
    frame = pd.DataFrame(rows, columns=["claim_id", "claim", "level", "origin", "verdict"])
    return frame.assign(**{"from": frame["origin"], "measured": "k/n", "estimate": "e",
                           "p_value": 0.5, "p_adj": 0.5, "p_sign": 0.5, "beside": "b",
                           "reason": ["", "", "", "", "", "", "no runs"]})


def test_summary_line_counts_each_verdict() -> None:
    """A table without roles counts every row; with roles, the primary rows decide."""
    assert claims_summary(_claims()) == ("E1/E2: 3 of 7 claims supported, 1 mixed, "
                                         "2 not supported, 1 not evaluated")
    e3 = _claims().assign(claim_id="E3.1", verdict="inconclusive")
    assert claims_summary(e3) == "E3: 0 of 7 claims supported, 7 inconclusive"
    roles = _claims().assign(role=["secondary", "primary", "secondary", "secondary", "primary",
                                   "secondary", "primary"])
    assert claims_summary(roles) == ("E1/E2: 2 of 3 claims supported, 1 not evaluated "
                                     "(primary rows; 4 secondary rows below)")
    assert claims_summary(_claims().iloc[:0]) == "No claims could be evaluated."


def test_summary_line_of_a_written_report(tmp_path: Path) -> None:
    _claims().to_csv(tmp_path / "claims.csv", index=False)
    assert summary_line(tmp_path).startswith("E1/E2: 3 of 7 claims supported")
    with pytest.raises(QKGeomError, match="no claims.csv"):
        summary_line(tmp_path / "nowhere")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "claims.csv").write_text("a,b\n1,2\n")
    with pytest.raises(QKGeomError, match="not a qkgeom claims table"):
        summary_line(tmp_path / "bad")


class _Cells(HTMLParser):
    """Every <td>: (its attributes, its text)."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.cells: list[tuple[dict, str]] = []
        self._open: dict | None = None
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "td":
            self._open, self._text = dict(attrs), ""

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._text += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._open is not None:
            self.cells.append((self._open, self._text.strip()))
            self._open = None


def test_rows_of_one_claim_are_gathered_under_it() -> None:
    by_level = _claims().sort_values("level", kind="stable")  # E4 lists claims per level
    md = claims_markdown(by_level)
    assert md.count("PR_Q expands") == 1 and md.count("Across heads, sharper") == 1
    groups = [line.split(" · ")[0][2:] for line in md.splitlines() if " · **" in line]
    assert groups == ["E1.1", "E1.2", "E2.3"]
    assert claims_summary(by_level).startswith("E1/E2: 3 of 7 claims supported")


def test_each_row_shows_one_p_the_verdicts_and_marks_the_primary_rows(tmp_path: Path) -> None:
    """The adjusted p (the one the verdict reads) is the row's only p in report.md and
    report.html; the raw and the sign test's stay in claims.csv; primary rows in bold."""
    claims = _claims().assign(p_value=0.0123, p_adj=0.0456, p_sign=0.0789,
                              role=["secondary", "primary", "secondary", "secondary",
                                    "primary", "secondary", "primary"])
    md = claims_markdown(claims)
    assert "0.046" in md and "0.012" not in md and "0.079" not in md
    header = md.splitlines()[0]
    assert header.count("| p ") == 1 and "p (adjusted)" in header
    rows = [line for line in md.splitlines()[2:] if " · **" not in line]
    assert [("**primary**" in line) for line in rows] == [
        r == "primary" for r in claims["role"]]
    page = render_html(md, tmp_path, "t")
    assert "0.046" in page and "0.012" not in page
    assert page.count("<strong>primary</strong>") == 3


def test_claims_table_is_grouped_by_claim_with_coloured_verdicts(tmp_path: Path) -> None:
    md = claims_markdown(_claims())
    assert md.count("PR_Q expands") == 1 and md.count("Across heads, sharper") == 1
    assert md.splitlines()[2].startswith("| E1.1 · **PR_Q expands** |")  # group row first
    page = render_html(md, tmp_path, "t")
    cells = _Cells(page).cells
    groups = [(a, t) for a, t in cells if "colspan" in a]
    assert [t for _, t in groups] == ["E1.1 · PR_Q expands", "E1.2 · PR_K shrinks",
                                      "E2.3 · Across heads, sharper"]
    assert {a["colspan"] for a, _ in groups} == {"8"}  # across the whole table
    assert page.count("PR_Q expands") == 1  # the claim text once
    verdicts = [(a.get("class"), t) for a, t in cells if "verdict" in a.get("class", "")]
    assert verdicts == [("verdict v-supported", "supported"),
                        ("verdict v-supported", "supported"), ("verdict v-mixed", "mixed"),
                        ("verdict v-not-supported", "not supported"),
                        ("verdict v-supported", "supported"),
                        ("verdict v-not-supported", "not supported"),
                        ("verdict v-not-evaluated", "not evaluated (no runs)")]  # words kept
    assert verdict_class("not supported") == "v-not-supported"
    assert verdict_class("rise then fall") is None


# ---------------------------------------------------------------------------------------
# E1 figures: seeds as lines below 5, as a t-band from 5; heads at the last probe
# ---------------------------------------------------------------------------------------


def _sweep(root: Path, seeds: tuple[int, ...]) -> pd.DataFrame:
    make_sweep(root, monotone_values(), depths=(2,), inits=("normal",), seeds=seeds,
               n_head=2)
    return collate(root).metrics


def _bands(fig) -> int:
    return sum(isinstance(c, PolyCollection) for ax in fig.axes for c in ax.collections)


def _thin(ax) -> list:
    """The thin per-seed lines of a panel (drawn as line collections)."""
    return [seg for c in ax.collections if isinstance(c, LineCollection)
            and c.get_linewidth()[0] == SEED_LINEWIDTH for seg in c.get_segments()]


@pytest.mark.parametrize(("make", "metrics"), [(fig_pr, 2), (fig_contrast, 1)])
def test_fewer_than_five_seeds_draw_each_seed_and_no_band(tmp_path: Path, make,
                                                          metrics: int) -> None:
    two = make(_sweep(tmp_path / "two", (0, 1)), "token")
    assert _bands(two) == 0
    assert len(_thin(two.axes[0])) == 2 * 2 * metrics  # 2 seeds × 2 layers × metrics
    five = make(_sweep(tmp_path / "five", tuple(range(BAND_MIN_UNITS))), "token")
    assert _bands(five) == 2 * metrics  # one t-band per layer and metric
    assert not _thin(five.axes[0])


def test_spread_note_says_which() -> None:
    assert "no interval below 5 seeds" in spread_note([2, 2])
    assert spread_note([5, 6]) == "seed mean ± 95\u00a0% t-interval over seeds (n = 5–6)"
    assert "its own line" in spread_note([1])
    assert "panels with ≥ 5 seeds show the t-interval" in spread_note([2, 5])


def test_pr_q_and_pr_k_share_a_panel(tmp_path: Path) -> None:
    fig = fig_pr(_sweep(tmp_path / "s", (0,)), "weight")
    ax = fig.axes[0]
    styles = sorted({line.get_linestyle() for line in ax.get_lines()
                     if line.get_linewidth() >= 1.0 and len(line.get_xdata()) > 2})
    assert styles == ["--", "-"] or styles == ["-", "--"]  # PR_Q solid, PR_K dashed
    assert len([a for a in fig.axes if a.get_lines()]) == 1  # one panel, not two rows


def test_heads_figure_shows_the_last_probe_only(tmp_path: Path) -> None:
    table = _sweep(tmp_path / "h", (0, 1))
    fig = fig_heads(table, "token")
    points = sum(len(c.get_offsets()) for c in fig.axes[0].collections)
    assert points == 2 * 2 * 2  # 2 runs × 2 layers × 2 heads, one probe (11 recorded)
    assert "last probe (step 100)" in fig._suptitle.get_text()


def test_layer_colours_are_distinct_and_readable_on_white() -> None:
    def contrast(c) -> float:
        rgb = np.array(to_rgb(c))
        lin = np.where(rgb <= 0.03928, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
        return 1.05 / (float(lin @ [0.2126, 0.7152, 0.0722]) + 0.05)

    for n in (1, 4, 8, 12, 24):
        colors = [to_rgb(c) for c in layer_colors(n)]
        assert len(colors) == n and len(set(colors)) == n
        assert min(contrast(c) for c in colors) > 2.2  # no pale yellow end (viridis: 1.3)


# ---------------------------------------------------------------------------------------
# Files: PNG at screen resolution + SVG; the page links large figures
# ---------------------------------------------------------------------------------------


def test_figures_are_png_at_screen_dpi_and_svg(tmp_path: Path) -> None:
    fig, axes = grid(1, 2)
    axes[0, 0].plot([0, 1], [0, 1])
    png, svg = save_figure(fig, tmp_path, "f")
    with Image.open(png) as im:
        dpi = im.info["dpi"][0]
        width = im.width
    assert dpi <= 200 and round(dpi) == SCREEN_DPI
    assert width == round(2 * PANEL_W * SCREEN_DPI)  # 2 panels
    assert svg.suffix == ".svg" and svg.read_text().lstrip().startswith("<?xml")


def test_report_links_its_large_figures_and_stays_small(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    make_sweep(root, monotone_values(), depths=(3,), inits=("normal", "tied"), seeds=(0, 1))
    md = write_report(root)
    out = md.parent
    pngs = sorted(out.glob("*.png"))
    assert pngs and all(p.with_suffix(".svg").is_file() for p in pngs)
    for png in pngs:
        with Image.open(png) as im:
            assert im.info["dpi"][0] <= 200
    page = (out / "report.html").read_text(encoding="utf-8")
    large = [p for p in pngs if p.stat().st_size > EMBED_MAX_BYTES]
    assert large  # this sweep's grids are larger than the embedding limit
    for p in large:
        assert f'src="{p.name}"' in page
    assert len(page.encode()) < 64_000 + len(pngs) * EMBED_MAX_BYTES * 4 // 3
    text = md.read_text(encoding="utf-8")
    assert text.splitlines()[2].startswith("> **E1/E2: ")  # the summary line opens it
    assert "no interval below 5 seeds" in text  # the captions say how seeds are shown


def test_a_run_probed_once_has_no_trajectory_figures_and_says_so(tmp_path: Path) -> None:
    run = write_run(tmp_path, "once", 2, "normal", 0, monotone_values(), steps=[0])
    md = write_report(run)
    assert sorted(p.stem for p in md.parent.glob("*.png")) == ["heads_token", "heads_weight"]
    note = md.read_text(encoding="utf-8").split("Not drawn (they would show nothing): ")[1]
    assert note.count("one probe step only: no trajectory to draw") == 6  # 3 kinds × 2 levels


# ---------------------------------------------------------------------------------------
# E4: one checkpoint, checkpoints without a step
# ---------------------------------------------------------------------------------------


def _e4_folder(root: Path, names: list[str], steps: list[int], source: str) -> Path:
    """An analysis folder as ``qkgeom analyze`` writes it (no token blocks): 2 layers × 4
    heads per checkpoint, every contrast metric per layer."""
    rows = []
    for name, step in zip(names, steps, strict=True):
        for layer in (0, 1):
            for metric in ("contrast_token_heads", "contrast_token", "contrast_weight"):
                rows.append((name, step, layer, -1, metric, 0.5 * layer + 0.1 * step))
            for head in range(4):
                for metric in ("pr_qk_token", "pr_qk_weight", "attn_entropy"):
                    rows.append((name, step, layer, head, metric, 1.0 + head + layer))
    m = pd.DataFrame(rows, columns=["checkpoint", "step", "layer", "head", "metric", "value"])
    m = m.assign(run_id="m", block=-1, in_trends=True, duplicate_of=None)
    return write_analysis(root, m, names, steps, model="gpt2", step_source=source)


def test_one_pretrained_checkpoint_skips_the_trajectories_with_a_note(tmp_path: Path) -> None:
    folder = _e4_folder(tmp_path / "an", ["gpt2"], [0], "order")
    md = write_report(folder)
    out = md.parent
    assert not (out / "contrast_steps.png").exists() and not (out / "prefix_trend.png").exists()
    assert (out / "qk_entropy_heads.png").is_file() and (out / "qk_entropy_heads.svg").is_file()
    text = md.read_text(encoding="utf-8")
    note = text.split("Not drawn (they would show nothing): ", 1)[1].split("\n", 1)[0]
    assert "`contrast_steps` (1 checkpoint in the trends: no trajectory to draw)" in note
    assert "`prefix_trend`" in note
    assert "| gpt2 | — |" in text and "| gpt2 | 0 |" not in text  # no made-up step 0
    assert "+0.000 @ gpt2 |" in text and "@ 0 |" not in text  # where layer 0 peaks
    assert text.splitlines()[2].startswith("> **E4: ")


def test_checkpoints_are_labelled_by_name_when_their_step_is_unknown(tmp_path: Path) -> None:
    assert checkpoint_label("gpt2", 0, "order") == "gpt2"
    assert checkpoint_label("step512", 512, "name") == "step512"  # says it already
    assert checkpoint_label("main", 143000, "trainer_state") == "main (step 143000)"
    folder = _e4_folder(tmp_path / "an", ["gpt2"], [0], "order")
    metrics = pd.read_parquet(folder / "metrics.parquet")
    fig = e4_fig_heads(metrics, pd.DataFrame(columns=["checkpoint", "level", "layer", "rho"]),
                       {"gpt2": "order"})
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["gpt2"]
