"""Checkpoint families spread over workers give the tables of the one-process analysis:
Ray tasks (``qkgeom analyze --backend ray`` on a local head), local processes; each job
writes its own cache entry, so failures and interruptions resume with what is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from qkgeom import make_config, train
from qkgeom.checkpoints.family import analyze_checkpoints
from qkgeom.errors import QKGeomError
from qkgeom.experiments.executors import make_executor

pytestmark = pytest.mark.slow  # trains a smoke run; starts processes

VARYING = ["seconds", "tokens_per_s"]  # wall-clock columns of checkpoints.parquet


@pytest.fixture(scope="module")
def run(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = make_config("smoke", {"data": str(sample_data), "steps": 20, "probe_every": 10,
                                "checkpoint_every": 5, "keep_checkpoints": 0, "threads": 1})
    return train(cfg, tmp_path_factory.mktemp("spread") / "run").out_dir


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("text") / "t.txt"
    path.write_text("Anthropology is the study of humans and their societies.\n" * 40)
    return str(path)


KW = {"max_tokens": 600, "seq_len": 30, "blocks": 2}


@pytest.fixture(scope="module")
def here(run: Path, text: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: every checkpoint in this process, one thread (as the workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return analyze_checkpoints([str(run)], tmp_path_factory.mktemp("here") / "an",
                                   text=text, **KW)
    finally:
        torch.set_num_threads(before)


def _same_tables(a: Path, b: Path) -> None:
    pd.testing.assert_frame_equal(pd.read_parquet(a / "metrics.parquet"),
                                  pd.read_parquet(b / "metrics.parquet"), check_exact=True)
    pd.testing.assert_frame_equal(pd.read_parquet(a / "checkpoints.parquet").drop(columns=VARYING),
                                  pd.read_parquet(b / "checkpoints.parquet").drop(columns=VARYING),
                                  check_exact=True)


def test_local_processes_give_the_same_tables_and_resume(run: Path, text: str, here: Path,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "an"
    executor = make_executor("local", workers=2, threads=1)
    analyze_checkpoints([str(run)], out, text=text, executor=executor, **KW)
    _same_tables(here, out)
    assert pd.read_parquet(out / "checkpoints.parquet")["step"].tolist() == [5, 10, 15, 20]
    # one cache entry lost (an interrupted job): only that checkpoint is measured again
    (out / "checkpoints" / "ckpt_00000010.json").unlink()
    kept = (out / "checkpoints" / "ckpt_00000005.parquet").stat().st_mtime_ns
    measured: list[str] = []

    def counting(measure, jobs):
        measured.extend(j.spec.name for j in jobs)
        yield from executor(measure, jobs)

    analyze_checkpoints([str(run)], out, text=text, executor=counting, **KW)
    assert measured == ["ckpt_00000010"]
    assert (out / "checkpoints" / "ckpt_00000005.parquet").stat().st_mtime_ns == kept
    _same_tables(here, out)


def test_a_failed_checkpoint_is_named_and_the_rest_is_cached(run: Path, text: str,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "an"

    def flaky(measure, jobs):  # runs here; the step-10 job fails
        for job in jobs:
            if job.spec.name == "ckpt_00000010":
                yield job, RuntimeError("worker lost")
            else:
                yield job, measure(job)

    with pytest.raises(QKGeomError) as err:
        analyze_checkpoints([str(run)], out, text=text, executor=flaky, **KW)
    message = str(err.value)
    assert "1 of 4 checkpoint(s) failed (ckpt_00000010: RuntimeError: worker lost)" in message
    assert "\n" not in message and "run the same command again" in message
    assert sorted(p.stem for p in (out / "checkpoints").glob("*.json")) == [
        "ckpt_00000005", "ckpt_00000015", "ckpt_00000020"]
    assert not (out / "metrics.parquet").exists()  # no table from a partial family
    analyze_checkpoints([str(run)], out, text=text, **KW)  # the rerun finishes it
    assert json.loads((out / "analysis.json").read_text())["state"] == "done"


def test_bad_executor_options_are_one_line_errors() -> None:
    for kwargs, words in [({"workers": 0}, "--workers"), ({"threads": 0}, "--threads"),
                          ({"address": "auto"}, "--address is for the ray backend")]:
        with pytest.raises(QKGeomError, match=words):
            make_executor("local", **kwargs)
    with pytest.raises(QKGeomError, match="unknown backend"):
        make_executor("slurm")
    assert make_executor("local", workers=1) is None  # one worker: this process


def test_analyze_backend_ray_gives_the_same_table(run: Path, text: str, here: Path,
                                                  tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from ray_cluster import LOOPBACK_ENV, ray_head

    out = tmp_path / "an"
    env = dict(os.environ, **LOOPBACK_ENV)
    with ray_head() as address:
        res = subprocess.run([sys.executable, "-m", "qkgeom.cli", "analyze", str(run),
                              "--text", text, "--tokens", str(KW["max_tokens"]), "--seq-len",
                              str(KW["seq_len"]), "--blocks", str(KW["blocks"]), "--out",
                              str(out), "--backend", "ray", "--address", address, "--quiet"],
                             capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    _same_tables(here, out)
