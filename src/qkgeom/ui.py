"""Terminal output (rich): progress, and tables that fit the terminal.

Redirected output (nohup, SLURM, CI logs) gets plain progress lines, since a bar would be
drawn once, at the end. A table wider than the console is split into several, each
repeating the index column, so no number is cut. Text from files may hold terminal control
sequences (OSC 52 sets the clipboard, a bidi override reorders a line): every cell and
title goes through :func:`printable` and reaches rich as plain text, never as markup.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

#: Width of tables written to a file or pipe (no terminal to ask), unless $COLUMNS says.
LOG_WIDTH = 100
# C0 and C1 controls, DEL, and the bidi marks and overrides that reorder what a line shows
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: object) -> str:
    """``text`` with every control character escaped (``\\x1b``, ``\\n``, ``\\u202e``):
    safe to show on a terminal, on one line, whatever a file held."""
    def escape(m: re.Match[str]) -> str:
        code = ord(m.group())
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return _CONTROL.sub(escape, str(text))


def plain(text: object) -> Any:
    """``text`` as a rich ``Text``: control characters escaped, no markup parsed."""
    from rich.text import Text

    return Text(printable(text))


def console(stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr), :data:`LOG_WIDTH` wide when redirected and
    ``$COLUMNS`` is unset."""
    from rich.console import Console

    out = Console(stderr=stderr)
    if out.is_terminal or os.environ.get("COLUMNS"):
        return out
    return Console(stderr=stderr, width=LOG_WIDTH)


def print_lines(lines: list[str]) -> None:
    """``lines`` on stdout, wrapped to the console at spaces; a line's wrapped rest indented
    two past its own indent, so a long item still reads as one."""
    import textwrap

    out = console()
    for line in lines:
        pad = " " * (len(line) - len(line.lstrip(" ")) + 2)
        wrapped = textwrap.fill(printable(line), out.width, subsequent_indent=pad,
                                break_on_hyphens=False)
        out.print(wrapped, highlight=False, markup=False, soft_wrap=True)


def progress_bar(label: str, *fields: str, stderr: bool = False) -> Progress:
    """A started-on-demand ``rich`` Progress; ``fields`` are format strings such as
    ``"loss {task.fields[loss]}"``."""
    from rich import progress as rp
    from rich.console import Console

    return rp.Progress(rp.TextColumn(label), rp.BarColumn(), rp.MofNCompleteColumn(),
                       *(rp.TextColumn(f) for f in fields), rp.TimeElapsedColumn(),
                       rp.TextColumn("eta"), rp.TimeRemainingColumn(),
                       console=Console(stderr=stderr))


def step_progress(label: str, total: int, done: int, every: int) -> StepProgress:
    """A rich bar when stdout is a terminal, else :class:`PlainSteps` lines every
    ``every`` steps (``every`` <= 0: only the last line)."""
    if console().is_terminal:
        return RichSteps(label, total, done)
    return PlainSteps(label, total, done, every)


def clock(seconds: float) -> str:
    """``h:mm:ss`` of a duration (negative counts as 0)."""
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _numbers(numbers: dict[str, float]) -> list[str]:
    """``loss 2.345``, ``val 2.401``, ``4,321 tok/s`` for the finite numbers given."""
    import math

    parts = []
    for key, fmt in (("loss", "loss {:.3f}"), ("val_loss", "val {:.3f}"),
                     ("tokens_per_s", "{:,.0f} tok/s")):
        value = numbers.get(key)
        if value is not None and math.isfinite(value):
            parts.append(fmt.format(value))
    return parts


class RichSteps:
    """The rich bar with loss and tokens/s (a terminal)."""

    def __init__(self, label: str, total: int, done: int) -> None:
        self._progress = progress_bar(f"[bold]{label}", "loss {task.fields[loss]}",
                                      "{task.fields[tps]} tok/s")
        self._task = self._progress.add_task(label, total=total, completed=done,
                                             loss="-", tps="-")
        self._progress.start()

    def advance(self) -> None:
        self._progress.advance(self._task)

    def update(self, step: int, **numbers: float) -> None:
        fields = {}
        if numbers.get("loss") is not None:
            fields["loss"] = f"{numbers['loss']:.3f}"
        if numbers.get("tokens_per_s") is not None:
            fields["tps"] = f"{numbers['tokens_per_s']:,.0f}"
        self._progress.update(self._task, **fields)

    def close(self) -> None:
        self._progress.stop()


#: Longest wall time between two plain progress lines, whatever ``every`` says: a log
#: shows a sign of life between probes.
HEARTBEAT_S = 30.0


class PlainSteps:
    """One plain line per ``every`` steps, at least every ``heartbeat_s`` of wall time and
    at the end (step, share, losses, tokens/s, elapsed, ETA), flushed at once so ``tail -f``
    of a job's log shows it. ``clock``: seconds (a test's own)."""

    def __init__(self, label: str, total: int, done: int, every: int,
                 stream: Any = None, heartbeat_s: float = HEARTBEAT_S,
                 clock: Any = time.perf_counter) -> None:
        self.label, self.total, self.every = label, total, every
        self.stream = stream if stream is not None else sys.stdout
        self.heartbeat_s, self._clock = heartbeat_s, clock
        self.step = self._start = done
        self._t0 = self._last = clock()
        self._latest: dict[str, float] = {}
        self._printed = done
        self._next = self._after(done)

    def _after(self, step: int) -> int:
        return (step // self.every + 1) * self.every if self.every > 0 else self.total

    def advance(self) -> None:
        self.step += 1
        if self.step < self.total and self._clock() - self._last >= self.heartbeat_s:
            self._line()

    def update(self, step: int, **numbers: float) -> None:
        """Newest numbers at ``step``; a line when ``step`` reached the next multiple of
        ``every`` (numbers arrive at log steps, so a line may come a few steps later)."""
        self.step = step
        self._latest.update({k: v for k, v in numbers.items() if v is not None
                             and v == v})  # keep the last val loss while evals are NaN
        if step >= self._next and step < self.total:
            self._line()

    def _line(self) -> None:
        self._last = self._clock()
        elapsed = self._last - self._t0
        did = self.step - self._start
        rate = did / elapsed if elapsed > 0 and did > 0 else 0.0
        eta = clock((self.total - self.step) / rate) if rate else "?"
        share = 100 * self.step / max(self.total, 1)
        parts = [f"{self.label} step {self.step}/{self.total} ({share:.0f} %)",
                 *_numbers(self._latest), f"elapsed {clock(elapsed)}", f"eta {eta}"]
        print("  ".join(parts), file=self.stream, flush=True)
        self._printed = self.step
        self._next = self._after(self.step)

    def close(self) -> None:
        if self.step != self._printed:
            self._line()


#: Progress of a loop over steps: ``advance`` per step, ``update`` with the newest numbers
#: (``loss``, ``val_loss``, ``tokens_per_s``), ``close`` at the end.
StepProgress = RichSteps | PlainSteps


# ----------------------------------------------------------------------------- tables


def _cell(col: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{value:+.3f}" if col.startswith("Δ") else f"{value:.3f}"
    return str(value)


def rich_table(table: pd.DataFrame, title: str | None = None, index: str = "layer") -> Table:
    """``table`` (one row per ``index`` value, e.g.
    :func:`qkgeom.analysis.tables.layer_table`) as a ``rich`` Table: values to 3 decimals,
    changes (Δ columns) signed, numbers never wrapped."""
    from rich.table import Table

    out = Table(title=plain(title) if title is not None else None)
    out.add_column(plain(index), justify="right", no_wrap=True)
    for col in table.columns:
        out.add_column(plain(col), justify="right", no_wrap=True)
    for key, row in table.iterrows():
        out.add_row(plain(key), *(plain(_cell(str(col), v)) for col, v in row.items()))
    return out


def column_chunks(table: pd.DataFrame, width: int, index: str = "layer") -> list[list[str]]:
    """The columns of ``table`` in consecutive groups that each fit ``width`` with the
    ``index`` column (a too wide column gets one of its own): as few groups as fit, as even
    as they can be (never a lone last column)."""
    from rich.cells import cell_len

    def need(name: str, cells: list[str]) -> int:  # text + padding (2) + one border
        return max([cell_len(name), *map(cell_len, cells)]) + 3

    base = 1 + need(index, [str(k) for k in table.index])  # the left border + index
    widths = [need(str(c), [_cell(str(c), v) for v in table[c]]) for c in table.columns]

    def pack(limit: int) -> list[list[str]]:
        chunks: list[list[str]] = []
        used = limit  # forces a first chunk
        for col, w in zip(table.columns, widths, strict=True):
            if used + w > limit and (not chunks or chunks[-1]):
                chunks.append([])
                used = base
            chunks[-1].append(col)
            used += w
        return chunks

    fewest = pack(width)
    # the narrowest limit that still needs no more tables: the widths even out
    limit = width
    while limit > base + max(widths, default=0) and len(pack(limit - 1)) <= len(fewest):
        limit -= 1
    return pack(limit)


def legend_lines(entries: Sequence[str], width: int, sep: str = "; ") -> list[str]:
    """``entries`` joined by ``sep`` into lines of at most ``width`` characters, never
    breaking inside an entry (one longer than ``width`` gets a line of its own)."""
    from rich.cells import cell_len

    lines: list[str] = []
    for entry in entries:
        if lines and cell_len(lines[-1] + sep + entry) < width:
            lines[-1] += sep + entry
        else:
            if lines:
                lines[-1] += sep.rstrip()
            lines.append(entry)
    return lines


def render_layers(table: pd.DataFrame, title: str, legend: Sequence[str] = (),
                  index: str = "layer") -> None:
    """Print a per-layer ``table`` (see :func:`rich_table`), split into as many tables as
    the console width needs, then the ``legend`` entries (what the column names mean)."""
    from rich.cells import cell_len

    out = console()
    chunks = column_chunks(table, out.width, index) or [[]]
    for i, cols in enumerate(chunks):
        part = f" ({i + 1}/{len(chunks)})" if len(chunks) > 1 else ""
        shown = rich_table(table[cols], title + part, index)
        shown.min_width = min(cell_len(title + part), out.width)  # the title never wraps
        out.print(shown)
    for line in legend_lines(legend, out.width):
        out.print(plain(line), highlight=False)  # a line wider than the console wraps


def _narrowest(frame: pd.DataFrame, rows: list[list[str]], group: Sequence[str]) -> int:
    """Characters the table needs when its short texts keep their line and every other
    text wraps at spaces (rich's borders and padding: 3 per column and 1)."""
    width = 3 * len(frame.columns) + 1
    for i, col in enumerate(frame.columns):
        cells = [str(col), *(r[i] for r in rows)]
        if col in group or max(map(len, cells[1:]), default=0) > 24:
            width += max(len(w) for c in cells for w in (c.split() or [""]))
        else:
            width += max(map(len, cells))
    return width


def render_frame(frame: pd.DataFrame, title: str, legend: Sequence[str] = (),
                 group: Sequence[str] = ()) -> None:
    """Print a small table (sweep status, claims): floats to 3 significant digits, numbers
    never wrapped, texts wrapped at spaces to fit (short ones only when it must).
    ``group`` columns name a group of consecutive rows (a claim's id and text): shown on
    its first row only, with a rule between groups."""
    from rich.table import Table

    out = console()
    where = [list(frame.columns).index(c) for c in group]
    rows: list[list[str]] = []
    sections: list[bool] = []
    previous = None
    for row in frame.itertuples(index=False):
        cells = ["" if v is None else f"{v:.3g}" if isinstance(v, float) else printable(v)
                 for v in row]
        key = tuple(cells[i] for i in where)
        sections.append(bool(where) and previous is not None and key != previous)
        if where and key == previous:
            for i in where:
                cells[i] = ""
        previous = key
        rows.append(cells)
    keep_short = _narrowest(frame, rows, group) <= out.width
    table = Table(title=plain(title))
    for col in frame.columns:
        numeric = frame[col].map(lambda v: isinstance(v, (int, float))).all()
        short = keep_short and col not in group and frame[col].astype(str).str.len().max() <= 24
        table.add_column(plain(col), no_wrap=bool(numeric or short), overflow="fold")
    for cells, section in zip(rows, sections, strict=True):
        if section:
            table.add_section()
        table.add_row(*(plain(c) for c in cells))
    out.print(table)
    for line in legend_lines(legend, out.width):
        out.print(plain(line), highlight=False)  # a line wider than the console wraps
