"""A command whose optional package is missing stops with one line naming the extra that
brings it (issue 24, point 1), for every extra, before it writes anything.

Each case runs the real CLI in a fresh interpreter in which the extra's packages cannot
be imported, as in a venv without them: ``importlib``'s path finder is told not to find
them (so ``import x`` raises ``ModuleNotFoundError`` and ``importlib.util.find_spec``
returns None, exactly as when they are not installed), while everything else of this
venv stays importable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

#: Runs ``qkgeom ARGS`` with the packages named in argv[1] (comma-separated) not findable.
BLOCKED_RUN = """
import sys
from importlib.machinery import PathFinder

blocked = set(sys.argv[1].split(","))
find = PathFinder.find_spec

def find_spec(name, path=None, target=None):
    if name.split(".")[0] in blocked:
        return None  # as if no folder on sys.path held it
    return find(name, path, target)

PathFinder.find_spec = staticmethod(find_spec)
assert not [m for m in sys.modules if m.split(".")[0] in blocked], "imported already"
from qkgeom.cli import main
main(sys.argv[2:])
"""

HF = "transformers,huggingface_hub,tokenizers,safetensors,accelerate"


def run_without(packages: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED_RUN, packages, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def one_line(res: subprocess.CompletedProcess, extra: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr  # no traceback
    assert lines[0].startswith("qkgeom: error: "), lines
    assert extra in lines[0], lines
    return lines[0]


def test_the_blocker_hides_a_package_as_an_uninstalled_one_is_hidden(tmp_path: Path) -> None:
    code = ("import importlib.util, sys\n"
            "print(importlib.util.find_spec('rich') is not None)\n"
            "try:\n    import yaml\nexcept ModuleNotFoundError as e:\n    print(e.name)\n")
    res = subprocess.run([sys.executable, "-c", BLOCKED_RUN.replace(
        "from qkgeom.cli import main\nmain(sys.argv[2:])", code), "yaml,rich"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.stdout.split() == ["False", "yaml"], res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("packages, name", [
    ("scipy,matplotlib,markdown", "scipy"),  # a venv without the extra: the first one used
    ("markdown", "markdown")])  # (it used to be re-raised as a bare ImportError)
def test_report_extra(smoke_run, tmp_path: Path, packages: str, name: str) -> None:
    out = tmp_path / "report"
    line = one_line(run_without(packages, "report", str(smoke_run.path), "--out", str(out),
                                cwd=tmp_path), "pip install 'qkgeom[report]'")
    assert f"the {name} package" in line
    assert not out.exists()  # refused before anything was written


@pytest.mark.slow
def test_hf_extra_for_analyze_and_export(smoke_run, tmp_path: Path) -> None:
    """The issue's case: `qkgeom analyze gpt2 --tokens 1000` in the `make demo` venv."""
    line = one_line(run_without(HF, "analyze", "gpt2", "--tokens", "1000", "--out",
                                str(tmp_path / "ckpt"), cwd=tmp_path), "pip install 'qkgeom[hf]'")
    assert "transformers" in line
    one_line(run_without(HF, "export", str(smoke_run.path), "--out", str(tmp_path / "hf"),
                         cwd=tmp_path), "pip install 'qkgeom[hf]'")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_data_extra(tmp_path: Path) -> None:
    one_line(run_without("datasets", "data", "prepare", "--source", "wikitext-103", "--dir",
                         str(tmp_path / "wt103"), cwd=tmp_path), "pip install 'qkgeom[data]'")
    assert not (tmp_path / "wt103").exists()


@pytest.mark.slow
def test_tensorboard_extra_and_wandb(sample_cache: Path, tmp_path: Path) -> None:
    for target, hint in (("tensorboard", "pip install 'qkgeom[tensorboard]'"),
                         ("wandb", "pip install wandb")):
        out = tmp_path / target
        one_line(run_without(target, "train", "--preset", "smoke", "--data", "sample",
                             "--out", str(out), "--report-to", target, cwd=tmp_path), hint)
        assert not out.exists()


@pytest.mark.slow
def test_ray_extra(sample_cache: Path, tmp_path: Path) -> None:
    grid = tmp_path / "grid.yaml"
    grid.write_text("name: g\npreset: smoke\naxes:\n  seed: [0, 1]\n")
    line = one_line(run_without("ray", "sweep", "run", str(grid), "--backend", "ray", "--out",
                                str(tmp_path / "sweep"), cwd=tmp_path),
                    "pip install 'qkgeom[ray]'")
    assert "ray" in line.lower()
    assert not (tmp_path / "sweep" / "runs").exists()  # no run trained
