"""Helpers for tests/faults: run the CLI, check one-line errors, compare run folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from cli_helpers import in_process  # noqa: F401  (re-exported for the fault tests)

FIGURES: list[str] = []
TALLIES: dict[str, list[int]] = {}  # fuzzed attack -> [inputs tried, handled cleanly, ran]
METRIC_COLS = ["step", "layer", "head", "metric", "value"]
LOG_COLS = ["step", "loss", "val_loss", "lr"]


def figure(name: str, text: str) -> None:
    """Print a test's figure and keep it for the end-of-run summary."""
    line = f"FIGURE {name}: {text}"
    print(line)
    FIGURES.append(line)


def group_figure(name: str, results: dict[str, bool]) -> Any:
    """A module's autouse fixture that prints its attack group's figure (:func:`held` of
    ``results``) once the module's tests have run: ``_figure = group_figure(name, RESULTS)``."""
    @pytest.fixture(scope="module", autouse=True)
    def _figure() -> Iterator[None]:
        yield
        figure(name, held(results))

    return _figure


def held(results: dict[str, bool]) -> str:
    """A group's figure: ``k/n attacks held (name; name ...)``."""
    return (f"{sum(results.values())}/{len(results)} attacks held "
            f"({'; '.join(results) or 'none ran'})")


def tree(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every entry under ``root`` (links not followed): kind, size and mtime, for "nothing
    created, changed or truncated" checks."""
    out = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
        out[str(path.relative_to(root))] = (kind, info.st_size if kind == "file" else 0,
                                            info.st_mtime_ns if kind == "file" else 0)
    return out


def files(folder: Path) -> dict[str, bytes]:
    """Every plain file under ``folder`` (links not followed) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def tally(attack: str, ok: bool, ran: bool = False) -> None:
    """Count one fuzzed input of ``attack`` (shown in the end-of-run summary); ``ran``: it
    was accepted and really trained."""
    counts = TALLIES.setdefault(attack, [0, 0, 0])
    counts[0] += 1
    counts[1] += int(ok)
    counts[2] += int(ran)


def cli(*args: str, fault: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m qkgeom.cli ARGS`` to completion; ``fault`` sets QKGEOM_FAULT."""
    return subprocess.run([sys.executable, "-m", "qkgeom.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=fault_env(fault))


def popen(*args: str, fault: str | None = None, pause: Path | None = None) -> subprocess.Popen:
    """The CLI started in its own session (so a kill can take its workers down too);
    ``pause``: the flag of a ``pause`` fault (``QKGEOM_FAULT_PAUSE``)."""
    env = fault_env(fault)
    if pause is not None:
        env["QKGEOM_FAULT_PAUSE"] = str(pause)
    return subprocess.Popen([sys.executable, "-m", "qkgeom.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)


def fault_env(fault: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("QKGEOM_FAULT", "QKGEOM_FAULT_PAUSE")}
    if fault:
        env["QKGEOM_FAULT"] = fault
    return env


def error_lines(stderr: str) -> list[str]:
    """stderr without one-line warnings and progress noise."""
    return [ln for ln in stderr.strip().splitlines() if ln.strip()
            and not ln.startswith("qkgeom: warning:")]


def clean_error(code: int, stderr: str, expect: int = 2, words: tuple[str, ...] = ()) -> bool:
    """Exit ``expect``, no traceback, exactly one error line holding every word."""
    lines = error_lines(stderr)
    return (code == expect and "Traceback" not in stderr and len(lines) == 1
            and all(w in lines[0] for w in words))


def assert_clean_error(code: int, stderr: str, expect: int = 2, words: tuple[str, ...] = ()
                       ) -> None:
    assert clean_error(code, stderr, expect, words), (code, stderr)


def train_args(data: Path, out: Path, steps: int, every: int = 4, *extra: str) -> list[str]:
    """A smoke run with a checkpoint, a probe and an eval every ``every`` steps."""
    return ["train", "--preset", "smoke", "--data", str(data), "--out", str(out), "--quiet",
            "--threads", "1", "--steps", str(steps), "--set", f"checkpoint_every={every}",
            "--set", f"probe_every={every}", "--set", f"eval_every={every}",
            "--set", f"log_every={every}", "--set", "warmup_steps=2", *extra]


def tiny_base(data: Path, steps: int = 4, every: int = 4) -> dict[str, Any]:
    """A grid's ``base`` for the run of :func:`train_args` (``steps``, ``every``)."""
    return {"data": str(data), "steps": steps, "checkpoint_every": every,
            "probe_every": every, "eval_every": every, "log_every": every,
            "warmup_steps": min(2, steps)}


def train_in_process(data: Path, out: Path, steps: int, every: int = 4, **over: Any) -> Path:
    """The same run as :func:`train_args`, through the Python API (the reference)."""
    import qkgeom

    cfg = qkgeom.make_config("smoke", {
        "data": str(data), "steps": steps, "checkpoint_every": every, "probe_every": every,
        "eval_every": every, "log_every": every, "warmup_steps": 2, "threads": 1, **over})
    qkgeom.train(cfg, out)
    return out


def assert_same_results(ref: Path, run: Path) -> None:
    """Bit-for-bit equal metrics and train log (run_id and timing aside)."""
    a = pd.read_parquet(ref / "metrics.parquet")[METRIC_COLS]
    b = pd.read_parquet(run / "metrics.parquet")[METRIC_COLS]
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    la = pd.read_parquet(ref / "train_log.parquet")[LOG_COLS]
    lb = pd.read_parquet(run / "train_log.parquet")[LOG_COLS]
    pd.testing.assert_frame_equal(la, lb, check_exact=True)


def status(run: Path) -> dict[str, Any]:
    return json.loads((run / "status.json").read_text())


def assert_no_torn_files(run: Path) -> None:
    """Every result file present parses (atomic writes: old or new, never half)."""
    for name in ("config.json", "status.json"):
        if (run / name).exists():
            json.loads((run / name).read_text())
    for name in ("metrics.parquet", "train_log.parquet"):
        if (run / name).exists():
            pd.read_parquet(run / name)
