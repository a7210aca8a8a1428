"""The README runs as written: every command in it is run here, or marked in the README by
``<!-- not-run: why -->`` on the line before its block (the test honours the mark, counts
the marked blocks and wants a reason).

- Each ```python block (and those of the docs pages the README's detail moved to) runs in
  its own namespace (a reader copies one block) in a fresh working folder, with the
  embedded sample prepared and a smoke run standing in for ``runs/small``.
- The ```bash blocks run in order through the real CLI in one working folder, as a reader
  types them. The tour's training run is cut short here (:data:`SHORTER`: fewer steps, the
  same command otherwise), so the suite stays fast; what it prints is checked against the
  README's example.
- The metrics snippet also runs on a run that is still training (its rows only in
  ``metrics.parts/``), as the README promises.
- The README stays short: at most :data:`MAX_LINES` lines, the detail in docs/.
"""

from __future__ import annotations

import io
import re
import shlex
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from .conftest import invoke

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: Pages whose Python blocks moved there from the README (run as the README's were).
MOVED = [ROOT / "docs" / "control.md", ROOT / "docs" / "api.md"]
MAX_LINES = 260
BLOCK = re.compile(r"(?:<!-- not-run: (?P<why>[^>]*?) -->\n)?```(?P<lang>python|bash)\n"
                   r"(?P<code>.*?)```", re.DOTALL)
#: README command -> the flags the test adds to make it short (later flags win).
SHORTER = {"qkgeom train --preset small --steps 400 --out runs/small":
           ["--steps", "20", "--probe-every", "5", "--set", "eval_every=10",
            "--set", "checkpoint_every=20", "--set", "warmup_steps=5", "--quiet"]}


def blocks(path: Path, lang: str) -> list[tuple[str, int, str | None, str]]:
    """(page, line, reason it is not run or None, code) of every ``lang`` block."""
    text = path.read_text(encoding="utf-8")
    return [(path.name, text.count("\n", 0, m.start("code")), m.group("why"), m.group("code"))
            for m in BLOCK.finditer(text) if m.group("lang") == lang]


def python_blocks() -> list[tuple[str, int, str | None, str]]:
    return [b for page in (README, *MOVED) if page.is_file() for b in blocks(page, "python")]


def commands(code: str) -> list[str]:
    """The commands of a bash block: one per line (``\\`` continues it), comments and
    blank lines dropped."""
    out: list[str] = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split("  #", 1)[0].split(" # ", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(" ".join(line.split()))
    return out


def test_the_readme_is_short_and_says_why_a_block_is_not_run() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES
    found = blocks(README, "python") + blocks(README, "bash")
    assert len(blocks(README, "python")) >= 2 and len(blocks(README, "bash")) >= 3
    skipped = [(line, why) for _, line, why, _ in found if why is not None]
    assert all(why.strip() for _, why in skipped)
    assert len(skipped) <= 2, skipped  # the install and the two make commands
    assert all(why is None for _, _, why, _ in python_blocks())
    order = [h for h in re.findall(r"(?m)^## (.*)$", text)]
    assert order == ["Install", "The two commands", "Results", "A 5-minute tour",
                     "Where to go next"], order
    results = text.split("## Results", 1)[1]
    assert "<!-- results: regenerated from real runs by the lead -->\n| claim |" in results


def test_every_time_in_the_readme_carries_its_date() -> None:
    text = README.read_text(encoding="utf-8")
    for row in re.findall(r"(?m)^\| `make (?:demo|test)` \|.*$", text):
        assert re.search(r"\| 20\d\d-\d\d-\d\d \|$", row), row
    tour = text.split("## A 5-minute tour", 1)[1].split("```", 2)[1]
    assert re.search(r"# one run: .*\d+ (s|min).*20\d\d-\d\d-\d\d", tour), tour


def test_every_docs_link_of_the_readme_exists() -> None:
    assert all(page.is_file() for page in MOVED)
    text = README.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(((?:docs|src)/[^)#]+)", text):
        assert (ROOT / target).exists(), target


@pytest.mark.slow
def test_readme_shell_commands_run(sample_cache: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    ran = []
    for page, line, why, code in blocks(README, "bash"):
        if why is not None:
            continue
        for command in commands(code):
            args = shlex.split(command)
            assert args[0] == "qkgeom", (page, line, command)  # only qkgeom in runnable blocks
            res = invoke(*args[1:], *SHORTER.get(command, []), columns=100)
            assert res.exit_code == 0, (command, res.output, res.exception)
            ran.append((command, res.stdout))
    assert {c for c, _ in ran} >= set(SHORTER)
    shown = dict(ran)
    table = shown["qkgeom show runs/small"]
    # the README's example is of the 400-step run; here the run is 20 steps, probed every 5:
    # the same columns, and the change since the reference step (25 % of the run) beside
    # the change since step 0
    for column in ("PR_Q w", "PR_K tok", "contrast tok", "entropy", "ΔPR_Q tok@0",
                   "ΔPR_K tok@5"):
        assert column in table, column
    assert (tmp_path / "runs" / "small" / "report" / "report.html").is_file()


@pytest.mark.slow
def test_the_readme_show_example_is_of_the_tour_run() -> None:
    """The example table: the 400-step run's last probe, Δ since step 0 and since the
    reference step 100 (25 % of 400)."""
    text = README.read_text(encoding="utf-8")
    example = text.split("## A 5-minute tour", 1)[1].split("```text", 1)[1].split("```")[0]
    assert "runs/small — per-layer Q/K geometry at step 400" in example
    assert "ΔPR_Q tok@100" in example and "ΔPR_K tok@0" in example
    assert "step 500" not in text.split("## A 5-minute tour", 1)[1]


@pytest.mark.slow
@pytest.mark.parametrize("page, line, why, code", python_blocks(),
                         ids=[f"{page}:{line}" for page, line, _, _ in python_blocks()])
def test_readme_python_block_runs(page: str, line: int, why: str | None, code: str,
                                  smoke_run, sample_cache: Path, tmp_path: Path,
                                  monkeypatch) -> None:
    if "transformers" in code:
        pytest.importorskip("transformers", reason="the block needs qkgeom[hf]")
    work = tmp_path / "work"
    shutil.copytree(smoke_run.path, work / "runs" / "small",
                    ignore=shutil.ignore_patterns("tensorboard"))
    monkeypatch.chdir(work)
    printed = io.StringIO()
    with redirect_stdout(printed):
        exec(compile(code, f"{page}:{line}", "exec"), {"__name__": "__readme__"})
    # a filter that matches nothing (e.g. m.head == -1, a method compared with a number)
    # runs without error: what it printed shows it
    assert "Empty DataFrame" not in printed.getvalue(), printed.getvalue()


@pytest.mark.slow
def test_the_metrics_snippet_reads_a_run_still_training(sample_cache: Path, tmp_path: Path,
                                                       monkeypatch) -> None:
    from qkgeom import Callback, make_config, train

    code = next(c for _, _, _, c in blocks(README, "python") if "read_metrics" in c)
    monkeypatch.chdir(tmp_path)
    seen: dict[str, object] = {}

    class ReadMidway(Callback):
        def on_probe(self, ctx, metrics) -> None:
            if ctx.step != 20:
                return
            run = tmp_path / "runs" / "small"
            seen["parquet"] = (run / "metrics.parquet").exists()
            seen["parts"] = (run / "metrics.parts").is_dir()
            printed = io.StringIO()
            with redirect_stdout(printed):
                exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
            seen["printed"] = printed.getvalue()

    train(make_config("smoke"), tmp_path / "runs" / "small", callbacks=[ReadMidway()])
    assert seen["parquet"] is False and seen["parts"] is True  # a live run: parts only
    assert "Empty DataFrame" not in seen["printed"]
    steps = [int(s) for s in re.findall(r"(?m)^(\d+)\s", str(seen["printed"]))]
    assert steps[:2] == [0, 10], seen["printed"]
