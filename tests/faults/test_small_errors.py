"""Attack group 8: small inputs that used to end in a traceback. Each is now one line on
stderr naming what is wrong, exit 2, and nothing written: ``--config DIR``, ``--out .``
in a folder that holds files, ``export --out FILE``, ``--device mps:0`` where there is no
MPS, ``watch --interval inf|nan``, ``QKGEOM_CACHE=/dev/null``, a dangling cached
``data/sample`` link, a malformed ``QKGEOM_FAULT``, a garbage Ray ``--address``. And two
that would read what they should not: a ``sweep.json`` whose run entries name their own
folder (``dir``, outside the sweep: an older shape, refused whole, nothing read or written)
and a corpus folder with a link to a file outside it (refused, not trained on)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from fault_helpers import (
    assert_clean_error,
    group_figure,
    in_process,
    tiny_base,
    train_args,
    train_in_process,
    tree,
)

RESULTS: dict[str, bool] = {}


_figure = group_figure("one-line errors", RESULTS)


@pytest.fixture(scope="module")
def base_run(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_in_process(sample_data, tmp_path_factory.mktemp("small") / "base", 4, 4)


def test_config_that_is_a_folder(sample_data: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code, _, err = in_process([*train_args(sample_data, out, 4), "--config", str(tmp_path)],
                              capsys)
    assert_clean_error(code, err, words=(str(tmp_path), "is a folder"))
    assert not out.exists()
    RESULTS["train --config DIR"] = True


def test_out_dot(sample_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "paper.tex").write_text("mine")
    monkeypatch.chdir(work)
    code, _, err = in_process(train_args(sample_data, Path("."), 4), capsys)
    assert_clean_error(code, err, words=("exists and is not empty",))
    assert [p.name for p in work.iterdir()] == ["paper.tex"]  # nothing written into it
    (work / "paper.tex").unlink()  # an empty working folder is a fine --out
    code, _, err = in_process(train_args(sample_data, Path("."), 4), capsys)
    assert code == 0, err
    assert json.loads((work / "config.json").read_text())["run_id"] == "work"
    RESULTS["train --out ."] = True


def test_export_out_that_is_a_file(base_run: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", reason="export needs the hf extra")
    target = tmp_path / "model.bin"
    target.write_text("mine")
    code, _, err = in_process(["export", str(base_run), "--out", str(target)], capsys)
    assert_clean_error(code, err, words=(str(target), "not a folder"))
    assert target.read_text() == "mine"
    RESULTS["export --out FILE"] = True


def test_device_mps_index_without_mps(sample_data: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)  # as on Linux
    out = tmp_path / "run"
    code, _, err = in_process([*train_args(sample_data, out, 4), "--device", "mps:0"], capsys)
    assert_clean_error(code, err, words=("mps:0", "not available"))
    assert not out.exists()  # no "failed" folder left behind
    RESULTS["train --device mps:0 (no MPS)"] = True


@pytest.mark.parametrize("interval", ["inf", "nan"])
def test_watch_interval_that_is_not_a_number_of_seconds(
        base_run: Path, interval: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = in_process(["watch", str(base_run), "--interval", interval], capsys)
    assert_clean_error(code, err, words=("--interval", interval))
    RESULTS[f"watch --interval {interval}"] = True


def test_cache_that_is_dev_null(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QKGEOM_CACHE", "/dev/null")
    out = tmp_path / "run"
    code, _, err = in_process(["train", "--preset", "smoke", "--out", str(out), "--quiet"],
                              capsys)
    assert_clean_error(code, err, words=("/dev/null", "QKGEOM_CACHE"))
    assert not out.exists()
    RESULTS["QKGEOM_CACHE=/dev/null"] = True


def test_dangling_cached_sample_link(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    (cache / "data").mkdir(parents=True)
    (cache / "data" / "sample").symlink_to(tmp_path / "gone", target_is_directory=True)
    monkeypatch.setenv("QKGEOM_CACHE", str(cache))
    out = tmp_path / "run"
    code, _, err = in_process(["train", "--preset", "smoke", "--out", str(out), "--quiet"],
                              capsys)
    assert_clean_error(code, err, words=(str(cache / "data" / "sample"), "symbolic link"))
    assert not out.exists() and not (tmp_path / "gone").exists()
    RESULTS["dangling $QKGEOM_CACHE/data/sample link"] = True


@pytest.mark.parametrize("spec", ["kill:ckpt_*.pt:second", "explode:*", "kill"])
def test_malformed_fault_spec(sample_data: Path, tmp_path: Path, spec: str,
                              capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QKGEOM_FAULT", spec)
    out = tmp_path / "run"
    code, _, err = in_process(train_args(sample_data, out, 4), capsys)
    assert_clean_error(code, err, words=("QKGEOM_FAULT", spec))
    assert not (out / "config.json").exists()
    RESULTS[f"QKGEOM_FAULT={spec}"] = True


def test_garbage_ray_address(sample_data: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed")
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"name": "g", "preset": "smoke",
                                    "base": tiny_base(sample_data)}))
    code, _, err = in_process(["sweep", "run", str(grid), "--out", str(tmp_path / "s"),
                               "--backend", "ray", "--address", "garbage", "--quiet"], capsys)
    assert_clean_error(code, err, words=("cannot connect to Ray", "'garbage'"))
    RESULTS["sweep run --backend ray --address garbage"] = True


def test_sweep_record_dir_outside_the_sweep_is_never_read(
        base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep"
    foreign = tmp_path / "someone-elses-run"
    record = json.loads((base_run / "config.json").read_text())
    for folder, rid in ((sweep / "runs" / "r0", "r0"), (foreign, "foreign")):
        shutil.copytree(base_run, folder)
        (folder / "config.json").write_text(json.dumps({**record, "run_id": rid}))
    for where in (str(foreign), "../someone-elses-run"):
        (sweep / "sweep.json").write_text(json.dumps({
            "grid": {"name": "d", "preset": "smoke", "base": {}, "axes": {}},
            "runs": [{"run_id": "r0", "axes": {}, "config_hash": record["config_hash"]},
                     {"run_id": "r1", "axes": {}, "config_hash": record["config_hash"],
                      "dir": where}]}))
        before = tree(tmp_path)
        for command in ("report", "sweep status"):
            code, _, err = in_process([*command.split(), str(sweep)], capsys)
            assert_clean_error(code, err, words=(str(sweep / "sweep.json"), "'r1'", "'dir'",
                                                 "run the grid again"))
            assert tree(tmp_path) == before  # nothing written, no report folder
    RESULTS["sweep.json dir: /abs/run and ../run"] = True


def test_corpus_folder_with_a_link_out(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world, " * 800)
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's private notes " * 50)
    (corpus / "b.txt").symlink_to(secret)
    out = tmp_path / "data"
    code, _, err = in_process(["data", "prepare", "--source", "text", "--path", str(corpus),
                               "--dir", str(out)], capsys)
    assert_clean_error(code, err, words=(str(corpus / "b.txt"), "symbolic link"))
    assert not out.exists()
    RESULTS["corpus folder with a link to a file outside it"] = True
