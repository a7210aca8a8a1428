"""What a newcomer sees: one smoke run trained through the real CLI (in this process, so
its output is not a terminal, as under nohup, SLURM or CI), shared by the tests here."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

#: The width the tables must fit (a common terminal; logs get it too).
WIDTH = 100


def invoke(*args: str, columns: int = WIDTH, **env: str):
    """``qkgeom ARGS`` through typer's runner with ``$COLUMNS`` set; stdout only in
    ``.stdout`` (errors raise as Python exceptions: use :func:`qkgeom.cli.main` to see
    their one-line form)."""
    from qkgeom.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns), **env})


@pytest.fixture(scope="session")
def smoke_run(sample_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """``qkgeom train --preset smoke --report-to tensorboard`` (40 steps, probes every 10):
    ``.path`` the run folder, ``.stdout`` what it printed."""
    out = tmp_path_factory.mktemp("newcomer") / "runs" / "smoke"
    res = invoke("train", "--preset", "smoke", "--data", str(sample_data), "--out", str(out),
                 "--report-to", "tensorboard")
    assert res.exit_code == 0, (res.output, res.exception)
    return types.SimpleNamespace(path=out, stdout=res.stdout)


@pytest.fixture
def sample_cache(sample_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$QKGEOM_CACHE`` pointing at a copy of the session's prepared sample, so
    ``--data sample`` finds it ready (no second conversion)."""
    shutil.copytree(sample_data, tmp_path / "cache" / "data" / "sample")
    monkeypatch.setenv("QKGEOM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"
