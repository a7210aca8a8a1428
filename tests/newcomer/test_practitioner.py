"""What a practitioner reaches for after one run: ``read_metrics`` that fails at the typo
(and a wide view), ``qkgeom compare`` of two runs, ``qkgeom runs`` of a folder, ``show``
with the loss, ``reproduce --help`` from the registry, ``-h``, a smoke run cut short, and
docs links whose anchors exist. Through the CLI (typer's runner, or ``main`` for the
one-line errors) and the Python API, on the session's smoke run and copies of it with
planted changes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
from cli_helpers import in_process

from qkgeom.errors import QKGeomError

from .conftest import invoke

ROOT = Path(__file__).resolve().parents[2]


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns("tensorboard", "checkpoints"))
    return to


def _plant(run: Path, metric: str, layer: int, shift: float) -> None:
    """Add ``shift`` to ``metric`` of ``layer`` (head −1) at every probe of ``run``."""
    from qkgeom.io import write_parquet
    from qkgeom.runs import read_metrics

    m = read_metrics(run)
    rows = (m["metric"] == metric) & (m["layer"] == layer) & (m["head"] == -1)
    m.loc[rows, "value"] += shift
    write_parquet(run / "metrics.parquet", m)


# ----------------------------------------------------------------------------- read_metrics


def test_read_metrics_names_a_missing_run_in_one_line(smoke_run, tmp_path: Path) -> None:
    from qkgeom.runs import read_metrics

    runs = _copy(smoke_run.path, tmp_path / "runs" / "small").parent
    with pytest.raises(QKGeomError) as err:
        read_metrics(runs / "smal")
    message = str(err.value)
    assert message == f"{runs / 'smal'}: no such run folder; did you mean {runs / 'small'}?"
    (tmp_path / "empty").mkdir()
    with pytest.raises(QKGeomError, match=r"empty/metrics.parquet: not found; .* not a qkgeom"):
        read_metrics(tmp_path / "empty")
    assert read_metrics(tmp_path / "empty", missing_ok=True) is None  # a live view's poll


def test_show_of_a_typo_is_one_line(capsys, tmp_path: Path) -> None:
    code, out, err = in_process(["show", str(tmp_path / "runs" / "smal")], capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"qkgeom: error: {tmp_path / 'runs' / 'smal'}: no such "
                                        "run folder"]


def test_the_wide_view_is_one_row_per_step_layer_and_head(smoke_run) -> None:
    from qkgeom.runs import read_metrics

    long = read_metrics(smoke_run.path)
    wide = read_metrics(smoke_run.path, wide=True)
    keys = ["run_id", "step", "layer", "head"]
    assert list(wide.columns[:4]) == keys
    assert len(wide) == len(long.drop_duplicates(["step", "layer", "head"]))
    assert not wide.duplicated(keys).any()
    assert set(wide.columns[4:]) == set(long["metric"].astype(str))
    for row in long.sample(25, random_state=0).itertuples():  # every value in its cell
        cell = wide[(wide["step"] == row.step) & (wide["layer"] == row.layer)
                    & (wide["head"] == row.head)][str(row.metric)]
        assert cell.item() == row.value
    assert wide["step"].is_monotonic_increasing
    head_rows = wide[wide["head"] >= 0]
    assert head_rows["pr_qk_weight_full"].isna().all()  # a layer-only metric: NaN per head


# ----------------------------------------------------------------------------- compare


def test_compare_recovers_a_planted_difference(smoke_run, tmp_path: Path) -> None:
    from qkgeom.runs import compare_runs

    a = _copy(smoke_run.path, tmp_path / "a")
    b = _copy(smoke_run.path, tmp_path / "b")
    _plant(b, "pr_k_token", 1, 0.25)
    found = compare_runs(a, b)
    assert (found.step_a, found.step_b) == (40, 40)
    assert found.metrics == ["pr_q_token", "pr_k_token", "contrast_token", "pr_qk_token",
                             "attn_entropy"]
    diff = found.table.set_index(["layer", "metric"])["diff"]
    assert diff[(1, "pr_k_token")] == pytest.approx(0.25)
    assert (diff.drop((1, "pr_k_token")) == 0).all()  # nothing else moved
    res = invoke("compare", str(a), str(b), "--metric", "pr_k_token,logit_max", "--step",
                 "20", "--format", "json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["a"] == {"run": str(a), "step": 20} and doc["metrics"] == ["pr_k_token",
                                                                         "logit_max"]
    layer1 = doc["layers"][1]
    assert layer1["layer"] == 1
    assert layer1["pr_k_token_b"] - layer1["pr_k_token_a"] == pytest.approx(0.25)
    assert layer1["pr_k_token_diff"] == pytest.approx(0.25)
    assert doc["layers"][0]["logit_max_diff"] == 0
    csv = invoke("compare", str(a), str(b), "-m", "pr_k_token", "--format", "csv")
    table = pd.read_csv(__import__("io").StringIO(csv.stdout))
    assert list(table.columns) == ["layer", "pr_k_token_a", "pr_k_token_b", "pr_k_token_diff"]
    assert table["pr_k_token_diff"].round(6).tolist() == [0.0, 0.25]


def test_compare_table_for_people(smoke_run, tmp_path: Path) -> None:
    a = _copy(smoke_run.path, tmp_path / "a")
    b = _copy(smoke_run.path, tmp_path / "b\x1b[31mred")  # a name that would drive the terminal
    _plant(b, "attn_entropy", 0, -0.5)
    res = invoke("compare", str(a), str(b))
    assert res.exit_code == 0, res.output
    assert "\x1b" not in res.stdout and "\\x1b[31mred" in res.stdout  # escaped, as show does
    assert "per-layer Q/K geometry at step 40" in " ".join(res.stdout.split())  # wrapped
    for column in ("PR_Q tok A", "PR_K tok B", "Δentropy"):
        assert column in res.stdout, column
    assert "-0.500" in res.stdout and "ΔX = B − A" in res.stdout
    assert max(len(line) for line in res.stdout.splitlines()) <= 100


@pytest.mark.parametrize("args, message", [
    (["-m", "pr_k_tokn"], "metric 'pr_k_tokn' is not recorded per layer; did you mean "
                          "'pr_k_token'"),
    (["--step", "7"], "no probe at step 7; probed steps: 0, 10, 20, 30, 40"),
    (["--format", "xml"], "unknown --format 'xml'"),
])
def test_compare_bad_input_is_one_line(smoke_run, capsys, args: list[str], message: str) -> None:
    run = str(smoke_run.path)
    code, out, err = in_process(["compare", run, run, *args], capsys)
    assert code == 2 and out == "", err
    assert len(err.strip().splitlines()) == 1 and message in err, err


# ----------------------------------------------------------------------------- runs


def test_runs_lists_every_run_folder_under_a_folder(smoke_run, tmp_path: Path, capsys) -> None:
    from qkgeom.io import write_json
    from qkgeom.runs import list_runs, read_log

    root = tmp_path / "work"
    _copy(smoke_run.path, root / "runs" / "smoke")
    live = _copy(smoke_run.path, root / "sweeps" / "s" / "runs" / "seed1")
    status = json.loads((live / "status.json").read_text())
    write_json(live / "status.json", {**status, "state": "running", "step": 17})
    (root / "notes").mkdir()
    (root / "notes" / "config.json").write_text("{}")  # no status, no metrics: not a run
    found = list_runs(root)
    assert found["run"].tolist() == ["runs/smoke", "sweeps/s/runs/seed1"]
    assert found["state"].tolist() == ["done", "running"]
    assert found["step"].tolist() == [40, 17] and found["steps"].tolist() == [40, 40]
    log = read_log(smoke_run.path)
    assert found["loss"].tolist() == [log["loss"].dropna().iloc[-1]] * 2
    assert found["val_loss"].tolist() == [log["val_loss"].dropna().iloc[-1]] * 2
    res = invoke("runs", str(root), "--format", "json")
    doc = json.loads(res.stdout)
    assert [r["run"] for r in doc["runs"]] == ["runs/smoke", "sweeps/s/runs/seed1"]
    table = invoke("runs", str(root))
    assert table.exit_code == 0, table.output
    assert "sweeps/s/runs/seed1" in table.stdout and "running" in table.stdout
    assert f"{log['val_loss'].dropna().iloc[-1]:.3f}" in table.stdout
    code, out, err = in_process(["runs", str(root / "nope")], capsys)
    assert (code, out, err) == (2, "", f"qkgeom: error: {root / 'nope'}: no such folder\n")


# ----------------------------------------------------------------------------- show


def test_show_gives_the_last_losses(smoke_run) -> None:
    from qkgeom.runs import read_log

    log = read_log(smoke_run.path)
    loss, val = log["loss"].dropna().iloc[-1], log["val_loss"].dropna().iloc[-1]
    res = invoke("show", str(smoke_run.path), "--format", "json")
    doc = json.loads(res.stdout)
    assert doc["losses"] == {"loss": loss, "loss_step": 40, "val_loss": val,
                             "val_loss_step": 40}
    table = invoke("show", str(smoke_run.path), "--step", "0")
    assert (f"loss {loss:.3f} at step 40 · val loss {val:.3f} at step 40"
            in table.stdout)


# ----------------------------------------------------------------------------- help


def _help_text(*args: str) -> str:
    """``qkgeom ARGS --help`` as one line of words (the boxes and wrapping removed)."""
    res = invoke(*args, "--help", columns=200)
    assert res.exit_code == 0, res.output
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", res.stdout).split())


def test_reproduce_help_lists_every_experiment_and_preset_of_the_registry(monkeypatch
                                                                          ) -> None:
    from qkgeom.experiments import EXPERIMENTS, summary
    from qkgeom.experiments.experiment import Experiment, Preset

    text = _help_text("reproduce")
    assert set(EXPERIMENTS) >= {"e1", "e3", "e4", "stability"}
    for name, exp in EXPERIMENTS.items():
        assert f"{name} ({summary(exp)}; presets: {', '.join(exp.presets)})" in text, name
    assert "calibrate" in text.split("--preset", 1)[1]  # and among the sizes

    class Planted(Experiment):
        name = "planted"
        presets = {"tiny": Preset("smoke", {})}

    monkeypatch.setitem(EXPERIMENTS, "planted", Planted())
    assert "planted (" in _help_text("reproduce") and "tiny" in _help_text("reproduce")


@pytest.mark.parametrize("args", [(), ("train",), ("sweep",), ("sweep", "status"),
                                  ("compare",), ("runs",)])
def test_h_is_help(args: tuple[str, ...]) -> None:
    short, long = invoke(*args, "-h"), invoke(*args, "--help")
    assert short.exit_code == 0 and "Usage" in short.stdout
    assert short.stdout == long.stdout


def test_train_help_points_at_the_table_of_presets() -> None:
    text = _help_text("train")
    assert "table of presets: docs/training.md" in text and "README" not in text
    assert "| preset |" in (ROOT / "docs" / "training.md").read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- smoke cut short


def test_a_preset_cut_short_fits_its_cadences(sample_cache: Path, tmp_path: Path,
                                              capsys) -> None:
    from qkgeom.runs import load_config

    out = tmp_path / "five"
    with pytest.warns(UserWarning) as warned:
        code, _, err = in_process(["train", "--preset", "smoke", "--steps", "5", "--out",
                                   str(out), "--quiet"], capsys)
    assert code == 0, err
    assert [str(w.message) for w in warned] == [
        "steps 5 is shorter than the smoke preset's probe_every 10, eval_every 20, "
        "checkpoint_every 20: each set to 5 (give them to choose)"]
    cfg = load_config(out)
    assert (cfg.probe_every, cfg.eval_every, cfg.checkpoint_every, cfg.warmup_steps) == (
        5, 5, 5, 5)
    code, _, err = in_process(["train", "--preset", "smoke", "--steps", "5", "--probe-every",
                               "10", "--out", str(tmp_path / "mine"), "--quiet"], capsys)
    assert code == 2  # the user's own value is refused, not changed
    assert err.strip().splitlines() == ["qkgeom: error: probe_every (10) is larger than steps "
                                        "(5): the run would only be probed at its ends"]


# ----------------------------------------------------------------------------- docs links


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"(?m)^#{1,6} (.*)$", text):
        slug = _slug(heading)
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found | set(re.findall(r'<a (?:name|id)="([^"]+)"', text))


def test_every_anchor_of_the_docs_exists() -> None:
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#\s]*\.md|)#([^)\s]+)\)", text):
            dest = page.parent / target if target else page
            if not dest.is_file() or anchor not in _anchors(dest):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert broken == []
    assert "stability-demo" in _anchors(ROOT / "docs" / "results.md")  # the test can see one
