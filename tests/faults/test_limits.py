"""Attack group 5: resource bombs. Limits are checked before any work, in one line, and
nothing is written: YAML aliases (the "billion laughs") in a config or grid file, a
YAML file of more nodes than any config has, a grid that expands to more runs than a
sweep holds, ``eval_batches`` beyond what the val split can give, a negative
``analyze --batch-size``, a Ray run asking for more CPUs than the cluster has, and a
local sweep's ``--threads`` beyond the config's bound."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fault_helpers import (
    assert_clean_error,
    cli,
    group_figure,
    in_process,
    tiny_base,
    train_args,
    train_in_process,
)

RESULTS: dict[str, bool] = {}


_figure = group_figure("resource limits", RESULTS)


def _alias_bomb(levels: int = 6) -> str:
    """Each level a list of nine aliases of the one before: 9**levels leaves once
    expanded, from a few hundred bytes (levels=9, about 450 bytes: 387 million)."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_config_is_refused(sample_data: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    out = tmp_path / "run"
    code, _, err = in_process([*train_args(sample_data, out, 4), "--config", str(bomb)], capsys)
    assert_clean_error(code, err, words=(str(bomb), "aliases"))
    assert not out.exists()
    RESULTS["YAML alias bomb: train --config"] = True


def test_a_yaml_alias_bomb_grid_is_refused(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    grid = tmp_path / "bomb.yaml"
    grid.write_text("name: bomb\npreset: smoke\nbase: {steps: 4}\n" + _alias_bomb())
    out = tmp_path / "sweep"
    code, _, err = in_process(["sweep", "run", str(grid), "--out", str(out), "--quiet"], capsys)
    assert_clean_error(code, err, words=(str(grid), "aliases"))
    assert not out.exists()
    RESULTS["YAML alias bomb: sweep run"] = True


def test_a_grid_file_of_40000_keys_is_refused_before_it_is_built(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grid = tmp_path / "wide.yaml"
    grid.write_text("name: wide\npreset: smoke\nbase:\n"
                    + "".join(f"  k{i}: {i}\n" for i in range(40_000)))
    code, _, err = in_process(["sweep", "run", str(grid), "--out", str(tmp_path / "s"),
                               "--quiet"], capsys)
    assert_clean_error(code, err, words=(str(grid), "YAML nodes"))
    RESULTS["grid of 40 000 keys"] = True


def test_a_grid_of_more_runs_than_a_sweep_holds_is_refused_unexpanded() -> None:
    from qkgeom.errors import QKGeomError
    from qkgeom.experiments.grid import Grid

    grid = {"name": "huge", "preset": "smoke",
            "axes": {"seed": list(range(101)), "steps": list(range(20, 120))}}
    with pytest.raises(QKGeomError, match=r"expands to 10,100 runs; a sweep holds at most "
                                          r"10,000"):
        Grid.from_dict(grid)
    RESULTS["grid of 10 100 runs"] = True


def test_eval_batches_beyond_the_val_split_are_refused(sample_data: Path,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "run"
    # a subprocess with a deadline: before this check, the step-0 eval never ended
    res = cli(*train_args(sample_data, out, 4), "--set", "eval_batches=1000000000",
              timeout=120)
    assert_clean_error(res.returncode, res.stderr, words=("eval_batches", "1,000,000,000",
                                                          "val split"))
    assert not out.exists()
    RESULTS["eval_batches=1e9"] = True


@pytest.mark.parametrize("flag", ["--batch-size", "--seq-len"])
def test_analyze_refuses_a_negative_batch(sample_data: Path, tmp_path: Path, flag: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    run = train_in_process(sample_data, tmp_path / "run", 4, 4)
    out = tmp_path / "ana"
    code, _, err = in_process(["analyze", str(run), "--out", str(out), flag, "-1",
                               "--quiet"], capsys)
    assert_clean_error(code, err, words=(flag, "-1"))
    assert not out.exists()
    RESULTS[f"analyze {flag} -1"] = True


def test_local_sweep_threads_beyond_the_bound_are_refused(
        sample_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"name": "g", "preset": "smoke",
                                    "base": tiny_base(sample_data)}))
    out = tmp_path / "sweep"
    code, _, err = in_process(["sweep", "run", str(grid), "--out", str(out), "--threads",
                               "5000", "--quiet"], capsys)
    assert_clean_error(code, err, words=("--threads", "5000", "4096"))
    assert not out.exists()  # refused, not a run recorded "failed"
    RESULTS["sweep run --threads 5000 (local)"] = True


@pytest.mark.slow
def test_ray_runs_asking_for_more_cpus_than_the_cluster_are_refused(
        sample_data: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from ray_cluster import LOOPBACK_ENV, ray_head

    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"name": "g", "preset": "smoke",
                                    "base": tiny_base(sample_data)}))
    out = tmp_path / "sweep"
    with ray_head() as address:  # 2 CPUs
        # a deadline: before this check, the run waited for 3 CPUs for ever
        res = subprocess.run([sys.executable, "-m", "qkgeom.cli", "sweep", "run", str(grid),
                              "--out", str(out), "--backend", "ray", "--address", address,
                              "--threads", "3", "--quiet"], capture_output=True, text=True,
                             timeout=240, env=dict(os.environ, **LOOPBACK_ENV))
    assert_clean_error(res.returncode, res.stderr, words=("3 CPUs", "cluster has 2"))
    RESULTS["Ray run asking for 3 CPUs of 2"] = True
