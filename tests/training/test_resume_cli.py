"""The real CLI in subprocesses: kill -9 mid-run then --resume; exit codes; and bad input
through the same entry point in-process (exit code, one line, nothing written)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from cli_helpers import in_process

COLS = ["step", "layer", "head", "metric", "value"]


def qkgeom(*args: str, env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qkgeom.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, **kw)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkgeom.cli", *args],
                          capture_output=True, text=True, timeout=300)


def smoke_args(data: Path, out: Path) -> list[str]:
    return ["train", "--preset", "smoke", "--data", str(data), "--out", str(out), "--quiet",
            "--steps", "60", "--set", "checkpoint_every=10", "--threads", "1"]


@pytest.mark.slow
def test_kill_then_resume_gives_the_uninterrupted_metrics(sample_data: Path,
                                                          tmp_path: Path) -> None:
    ref = run(*smoke_args(sample_data, tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "killed"
    proc = qkgeom(*smoke_args(sample_data, out))
    deadline = time.time() + 240
    # Kill once the second checkpoint exists: mid-run, with records after the first.
    while time.time() < deadline and not (out / "checkpoints" / "ckpt_00000020.pt").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "running" and status["step"] < 60  # really interrupted
    res = run(*smoke_args(sample_data, out), "--resume")
    assert res.returncode == 0, res.stderr
    a = pd.read_parquet(tmp_path / "ref" / "metrics.parquet")[COLS]
    b = pd.read_parquet(out / "metrics.parquet")[COLS]
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    la = pd.read_parquet(tmp_path / "ref" / "train_log.parquet")
    lb = pd.read_parquet(out / "train_log.parquet")
    pd.testing.assert_frame_equal(la[["step", "loss", "val_loss", "lr"]],
                                  lb[["step", "loss", "val_loss", "lr"]], check_exact=True)
    assert json.loads((out / "status.json").read_text())["state"] == "done"


def test_cli_smoke_train_then_show(sample_data: Path, tmp_path: Path) -> None:
    res = run("train", "--preset", "smoke", "--data", str(sample_data), "--out",
              str(tmp_path / "r"), "--steps", "20")
    assert res.returncode == 0, res.stderr
    assert "run folder" in res.stdout and "PR_Q" in res.stdout
    quiet = run("train", "--preset", "smoke", "--data", str(sample_data), "--out",
                str(tmp_path / "q"), "--quiet", "--steps", "20")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == ""  # --quiet: nothing but warnings and errors
    show = run("show", str(tmp_path / "r"))
    assert show.returncode == 0 and "step 20" in show.stdout
    show0 = run("show", str(tmp_path / "r"), "--step", "0")
    assert show0.returncode == 0 and "step 0" in show0.stdout


@pytest.mark.parametrize("args, words", [
    (["--n-embd", "30", "--n-head", "4"], "divisible"),
    (["--qk-init", "xavier"], "qk_init"),
    (["--steps", "0"], "steps"),
    (["--precision", "fp8"], "precision"),
    (["--set", "model.depth=3"], "unknown config key"),
    (["--set", "nonsense"], "key=value"),
    (["--data", "/nonexistent/qkgeom-data"], "/nonexistent/qkgeom-data"),
    (["--probe-every", "1000", "--steps", "10"], "probe_every"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(sample_data: Path, tmp_path: Path,
                                                      args: list[str], words: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bad"
    base = ["train", "--preset", "smoke", "--out", str(out), "--quiet"]
    if "--data" not in args:
        base += ["--data", str(sample_data)]
    code, stdout, err = in_process([*base, *args], capsys)
    assert code == 2, (stdout, err)
    assert "Traceback" not in err
    assert words in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_show_on_a_missing_run_and_corrupt_metrics(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = in_process(["show", str(tmp_path / "nope")], capsys)
    assert code == 2 and "Traceback" not in err and "nope: no such run folder" in err
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "metrics.parquet").write_bytes(b"PAR1 torn")
    code, _, err = in_process(["show", str(tmp_path / "torn")], capsys)
    assert code == 2 and "unreadable" in err


def test_diverging_run_exits_3(sample_data: Path, tmp_path: Path) -> None:
    env = dict(os.environ)
    res = subprocess.run([sys.executable, "-m", "qkgeom.cli", "train", "--preset", "smoke",
                          "--data", str(sample_data), "--out", str(tmp_path / "div"), "--quiet",
                          "--lr", "1e6", "--set", "grad_clip=0", "--set", "warmup_steps=0"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 3, (res.stdout, res.stderr)
    status = json.loads((tmp_path / "div" / "status.json").read_text())
    assert status["state"] == "diverged" and status["diverged_step"] >= 1


def test_config_file_then_flags_then_set_override_in_that_order(sample_data: Path,
                                                                 tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("steps: 10\nprobe_every: 5\nmodel: {qk_init: xavier, n_layer: 1}\n")
    out = tmp_path / "r"
    base = ["train", "--preset", "smoke", "--data", str(sample_data), "--quiet",
            "--config", str(cfg)]
    bad = run(*base, "--out", str(out))
    assert bad.returncode == 2 and "qk_init" in bad.stderr  # the file was read
    res = run(*base, "--out", str(out), "--qk-init", "tied", "--steps", "8",
              "--set", "steps=6", "--set", "probe_every=3")
    assert res.returncode == 0, res.stderr
    saved = json.loads((out / "config.json").read_text())["config"]
    assert (saved["model"]["qk_init"], saved["model"]["n_layer"]) == ("tied", 1)
    assert (saved["steps"], saved["probe_every"]) == (6, 3)
