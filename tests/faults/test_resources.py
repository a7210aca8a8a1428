"""Attack 8: resources. A run or an analysis that cannot fit is refused before anything is
written, with the estimate in the one-line message; a context whose O(T²) probe would run
for minutes is refused with its time estimate; running out of memory mid-run is one line,
exit 2 and ``status: failed`` (never ``running``); a text that runs out before ``--tokens``
says so (a warning and ``analysis.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fault_helpers import (
    assert_clean_error,
    cli,
    figure,
    in_process,
    status,
    train_args,
    train_in_process,
)

RESULTS: dict[str, bool] = {}


@pytest.fixture(scope="module")
def small_run(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_in_process(sample_data, tmp_path_factory.mktemp("res") / "run", 8, 4)


def test_a_batch_that_cannot_fit_is_refused_before_anything_is_written(
        sample_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qkgeom.config import make_config
    from qkgeom.training.resources import available_memory, training_memory

    out = tmp_path / "huge"
    batch = 10**9
    cfg = make_config("smoke", {"batch_size": batch, "model": {"vocab_size": 256}})
    need = sum(training_memory(cfg).values())
    have, _ = available_memory(torch.device("cpu"))
    assert have is not None and need > 10 * have  # the attack really asks for too much
    code, _, err = in_process(train_args(sample_data, out, 8, 4, "--batch-size", str(batch)),
                              capsys)
    assert_clean_error(code, err, words=("needs about", "GiB", "available system memory",
                                         "batch_size"))
    assert not out.exists() and not out.with_name(".huge.lock").exists()
    RESULTS["train --batch-size 1e9"] = True


def test_an_absurd_context_is_refused_with_the_probe_estimate(
        sample_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "long"
    code, _, err = in_process(train_args(sample_data, out, 8, 4, "--block-size", "40000"),
                              capsys)
    assert_clean_error(code, err, words=("block_size 40000", "probe", " s on cpu",
                                         "probe_sequences"))
    seconds = float(err.split("about ")[1].split(" s on")[0].replace(",", ""))
    assert seconds > 120  # minutes of O(T²) work, as the attack found
    assert not out.exists()
    code, _, err = in_process(train_args(sample_data, tmp_path / "ok", 4, 4, "--block-size",
                                         "256"), capsys)
    assert code == 0, err  # a sensible context still trains
    RESULTS["train --block-size 40000"] = True


@pytest.mark.parametrize("error", [MemoryError, "cuda"])
def test_out_of_memory_mid_run_is_one_line_and_recorded_failed(
        sample_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, error: object) -> None:
    import qkgeom.training.trainer as trainer

    real, calls = trainer.measure, []

    def measure(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the probe at step 4 runs out of memory
            raise (MemoryError() if error is MemoryError else torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB"))
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "measure", measure)
    out = tmp_path / "oom"
    code, _, err = in_process(train_args(sample_data, out, 8, 4), capsys)
    assert len(calls) == 2  # the fault landed where planned
    assert_clean_error(code, err, words=("out of memory at step 4", "batch_size",
                                         "status.json"))
    st = status(out)
    assert st["state"] == "failed" and "out of memory" in st["error"] and st["step"] == 4
    from qkgeom.runs import read_metrics

    assert sorted(read_metrics(out)["step"].unique()) == [0]  # records so far kept
    RESULTS[f"out of memory mid-run ({getattr(error, '__name__', error)})"] = True


def test_any_crash_mid_run_is_recorded_failed_not_running(
        sample_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import qkgeom
    import qkgeom.training.trainer as trainer

    def broken(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(trainer, "measure", broken)
    cfg = qkgeom.make_config("smoke", {"data": str(sample_data), "steps": 4, "threads": 1,
                                       "warmup_steps": 2, "probe_every": 2})
    with pytest.raises(ValueError, match="a bug"):
        qkgeom.train(cfg, tmp_path / "bug")
    st = status(tmp_path / "bug")
    assert st["state"] == "failed" and st["error"] == "ValueError: a bug"


def test_analyze_refuses_a_batch_that_cannot_fit(small_run: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "an"
    code, _, err = in_process(["analyze", str(small_run), "--text", "sample", "--tokens",
                               str(10**12), "--batch-size", str(10**11), "--out", str(out),
                               "--quiet"], capsys)
    assert_clean_error(code, err, words=("needs about", "GiB", "--batch-size"))
    assert not out.exists()
    RESULTS["analyze --batch-size 1e11"] = True


def test_analyze_out_of_memory_is_one_line(small_run: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import qkgeom.geometry

    calls = []

    def measure(*args, **kwargs):
        calls.append(1)
        raise MemoryError()

    monkeypatch.setattr(qkgeom.geometry, "measure", measure)
    code, _, err = in_process(["analyze", str(small_run), "--out", str(tmp_path / "an"),
                               "--quiet"], capsys)
    assert calls and code == 2 and "Traceback" not in err
    assert err.strip().startswith("qkgeom: error: out of memory") and len(
        err.strip().splitlines()) == 1
    RESULTS["analyze out of memory"] = True


def test_analyze_says_when_the_text_runs_out(small_run: Path, tmp_path: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)  # 1,800 characters
    out = tmp_path / "an"
    res = cli("analyze", str(small_run), "--revisions", "8", "--text", str(text), "--tokens",
              str(10**12), "--out", str(out), "--quiet")
    assert res.returncode == 0, res.stderr
    warning = [ln for ln in res.stderr.splitlines() if ln.startswith("qkgeom: warning:")]
    assert len(warning) == 1 and "ran out after 1,800 tokens" in warning[0], res.stderr
    meta = json.loads((out / "analysis.json").read_text())
    assert meta["text_ran_out"] == {"max_tokens": 10**12, "tokens": 1800}
    full = cli("analyze", str(small_run), "--revisions", "8", "--text", str(text), "--tokens",
               "1000", "--out", str(tmp_path / "enough"), "--quiet")
    assert full.returncode == 0 and "warning" not in full.stderr
    assert "text_ran_out" not in json.loads((tmp_path / "enough" / "analysis.json").read_text())
    RESULTS["analyze --tokens 1e12 on a short text"] = True
    figure("resources", f"{sum(RESULTS.values())}/{len(RESULTS)} cases handled cleanly "
           f"({'; '.join(RESULTS)})")
