"""The README's Python snippets run as written. Each ```python block runs in its own
namespace (a reader copies one block) in a fresh working folder, with the embedded sample
prepared and a smoke run standing in for ``runs/demo``. A block that cannot run here (a
network, a GPU) is marked in the README by ``<!-- not-run: why -->`` on the line before
it; the test honours the mark and counts the marked blocks."""

from __future__ import annotations

import io
import re
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"(?:<!-- not-run: (?P<why>[^>]*?) -->\n)?```python\n(?P<code>.*?)```",
                   re.DOTALL)


def blocks() -> list[tuple[int, str | None, str]]:
    """(line, reason it is not run or None, code) of every python block."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start("code")), m.group("why"), m.group("code"))
            for m in BLOCK.finditer(text)]


def test_the_readme_has_python_blocks_and_says_why_any_is_not_run() -> None:
    found = blocks()
    assert len(found) >= 4
    skipped = [(line, why) for line, why, _ in found if why is not None]
    assert all(why.strip() for _, why in skipped)
    assert len(skipped) <= 1, skipped  # the README is meant to run; say so here if not


@pytest.mark.slow
@pytest.mark.parametrize("line, why, code", blocks(),
                         ids=[f"line{line}" for line, _, _ in blocks()])
def test_readme_python_block_runs(line: int, why: str | None, code: str, smoke_run,
                                  sample_cache: Path, tmp_path: Path, monkeypatch) -> None:
    if why is not None:
        pytest.skip(f"README line {line}: not-run: {why}")
    if "transformers" in code:
        pytest.importorskip("transformers", reason="the block needs qkgeom[hf]")
    work = tmp_path / "work"
    shutil.copytree(smoke_run.path, work / "runs" / "demo",
                    ignore=shutil.ignore_patterns("tensorboard"))
    monkeypatch.chdir(work)
    printed = io.StringIO()
    with redirect_stdout(printed):
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
    # a filter that matches nothing (e.g. m.head == -1, a method compared with a number)
    # runs without error: what it printed shows it
    assert "Empty DataFrame" not in printed.getvalue(), printed.getvalue()
