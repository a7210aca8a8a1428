"""CLI consistency: --version, --n-layer (and --depth), --data sample, did-you-mean, help
and defaults for every flag, no --no-no- flags, report names what it reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer

from qkgeom.version import __version__

from .conftest import invoke


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    from qkgeom.cli import main

    with pytest.raises(SystemExit) as stop:
        main(list(args))
    out = capsys.readouterr()
    return stop.value.code, out.out, out.err


def commands() -> dict[str, Any]:
    """Every leaf command of the app by its full name (``sweep status``): typer's click
    command objects (typer vendors its own click, so matched by shape, not class)."""
    from qkgeom.cli import app

    root = typer.main.get_command(app)
    out: dict[str, Any] = {}

    def walk(group: Any, prefix: str) -> None:
        for name, cmd in group.commands.items():
            if hasattr(cmd, "commands"):
                walk(cmd, f"{prefix}{name} ")
            else:
                out[f"{prefix}{name}"] = cmd

    walk(root, "")
    return out


def test_version(capsys) -> None:
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.strip() == f"qkgeom {__version__}"


def test_every_option_has_help_and_no_flag_is_doubly_negated() -> None:
    found = commands()
    assert {"train", "show", "analyze", "export", "report", "reproduce", "sweep status"} <= set(found)
    for name, cmd in found.items():
        for param in cmd.params:
            if param.param_type_name != "option" or param.name == "help":
                continue
            assert (param.help or "").strip(), f"{name} {param.opts[0]} has no help"
            for opt in (*param.opts, *param.secondary_opts):
                assert not opt.startswith("--no-no-"), f"{name} {opt}"
    train = {o for p in found["train"].params for o in p.opts}
    assert {"--n-layer", "--depth", "--report-to", "--progress-every", "--quiet"} <= train
    assert {"--logit-spectrum", "--no-logit-spectrum"} <= {
        o for p in found["analyze"].params for o in (*p.opts, *p.secondary_opts)}


def help_text(*command: str) -> str:
    """``--help`` of a command as plain words (rich's boxes and line breaks removed)."""
    res = invoke(*command, "--help", columns=200)
    assert res.exit_code == 0, res.output
    return " ".join(res.stdout.replace("│", " ").split())


def test_train_help_shows_the_presets_values() -> None:
    text = help_text("train")
    assert "smoke 2 · small 4 · paper 6" in text  # --n-layer
    assert "(default: auto)" in text  # --device


def test_report_help_names_what_it_reads() -> None:
    text = help_text("report")
    assert "sweep folder" in text and "analysis folder" in text and "run folder" in text


def test_did_you_mean_for_an_unknown_config_key(capsys, tmp_path: Path) -> None:
    code, _, err = run_main(capsys, "train", "--preset", "smoke", "--out", str(tmp_path / "r"),
                            "--set", "stpes=3")
    assert code == 2 and "unknown config key 'stpes'; did you mean 'steps'?" in err
    code, _, err = run_main(capsys, "train", "--preset", "smoke", "--out", str(tmp_path / "r"),
                            "--set", "model.depth=3")
    assert code == 2 and "did you mean 'model.n_layer'?" in err
    assert not (tmp_path / "r").exists()


def test_depth_data_sample_and_n_layer(sample_cache: Path, tmp_path: Path) -> None:
    short = ["--steps", "4", "--probe-every", "2", "--set", "eval_every=2",
             "--set", "checkpoint_every=2", "--set", "warmup_steps=1", "--quiet"]
    a = invoke("train", "--preset", "smoke", "--data", "sample", "--depth", "1",
               "--out", str(tmp_path / "a"), *short)
    assert a.exit_code == 0, (a.output, a.exception)
    record = json.loads((tmp_path / "a" / "config.json").read_text())
    assert record["config"]["model"]["n_layer"] == 1
    assert record["config"]["data"] == "sample"  # what the config's default names
    assert record["data_dir"] == str(sample_cache / "data" / "sample")
    b = invoke("train", "--preset", "smoke", "--data", "sample", "--n-layer", "1",
               "--out", str(tmp_path / "b"), *short)
    assert b.exit_code == 0, (b.output, b.exception)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["config_hash"] == \
        record["config_hash"]
