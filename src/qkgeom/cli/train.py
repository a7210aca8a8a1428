"""``qkgeom train`` and ``qkgeom show``: one run, and its per-layer table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from qkgeom.cli.output import Format, check_format, info, show_layers, unset
from qkgeom.config import DEVICE_HELP, PRESETS, TrainConfig, deep_merge, flatten, nest_keys
from qkgeom.errors import QKGeomError

# CLI flag -> dotted config key (flags left None keep the preset's value).
_FLAG_KEYS = {"n_layer": "model.n_layer", "depth": "model.n_layer",  # --depth is --n-layer
              "n_embd": "model.n_embd", "n_head": "model.n_head",
              "block_size": "model.block_size", "qk_init": "model.qk_init",
              "key_control": "key_control.mode", "dose": "key_control.dose",
              "key_control_scope": "key_control.scope",
              "key_control_level": "key_control.level"}


def _preset_help(text: str, key: str) -> str:
    """``text (presets: smoke 2 · small 4 · paper 6).``: the help of a flag whose default is
    the preset's value of ``key`` (dotted)."""
    defaults = TrainConfig().to_dict()
    values = " · ".join(f"{name} {flatten(deep_merge(defaults, preset))[key]}"
                        for name, preset in PRESETS.items())
    return f"{text.rstrip('.')} (presets: {values})."


#: Cadences a preset sets that a run shorter than them brings down to its length.
FIT_TO_STEPS = ("probe_every", "eval_every", "checkpoint_every", "warmup_steps")


def fit_preset_to_steps(preset: str, overrides: dict[str, Any]
                        ) -> tuple[dict[str, Any], str]:
    """``overrides`` with each of :data:`FIT_TO_STEPS` that the preset sets above the run's
    ``steps`` (given in ``overrides``) brought down to ``steps``, and the warning naming
    them ("" when none): ``--preset smoke --steps 5`` runs. A value the user set (flag,
    ``--set``, config file) is theirs: left alone, and refused by the config when it does
    not fit."""
    given = flatten(overrides)
    steps = given.get("steps")
    if preset not in PRESETS or not isinstance(steps, int) or isinstance(steps, bool) \
            or steps < 1:
        return overrides, ""  # nothing to fit, or make_config refuses it in one line
    base = flatten(deep_merge(TrainConfig().to_dict(), PRESETS[preset]))
    lowered = {key: steps for key in FIT_TO_STEPS
               if key not in given and isinstance(base.get(key), int) and base[key] > steps}
    if not lowered:
        return overrides, ""
    values = ", ".join(f"{key} {base[key]}" for key in lowered)
    several = len(lowered) > 1
    return deep_merge(overrides, lowered), (
        f"steps {steps} is shorter than the {preset} preset's {values}: "
        f"{'each' if several else 'it'} set to {steps} (give {'them' if several else 'it'} "
        "to choose)")


def train_overrides(**flags: Any) -> dict[str, Any]:
    """Nested config overrides from CLI flags; None = not given."""
    return nest_keys({_FLAG_KEYS.get(k, k): v for k, v in flags.items() if v is not None},
                     "flags")


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML/JSON mapping of config overrides, or a one-line error (the YAML limits of
    :func:`qkgeom.config.load_yaml_file`: no aliases, a node budget)."""
    from qkgeom.config import load_yaml_file

    loaded = load_yaml_file(path, "config file")
    if not isinstance(loaded, dict):
        raise QKGeomError(f"{path}: a config file must be a mapping of keys to values")
    return loaded


def _show_metrics(run: Path, metrics: Any, step: int | None, ref: int | None,
                  fmt: str = "table", extra: dict[str, Any] | None = None) -> None:
    """The per-layer table of ``metrics`` (a run's) at ``step``, changes since ``ref``
    (``extra``: more keys of the JSON document)."""
    from qkgeom.analysis.tables import layer_table
    from qkgeom.runs import METRICS

    try:
        at, table = layer_table(metrics, step, ref)
    except ValueError as err:
        raise QKGeomError(f"{run / METRICS}: {err}") from None
    show_layers(table, f"{run} — per-layer Q/K geometry at step {at}", fmt,
                {"run": str(run), "step": at, **(extra or {})})


def _report_callbacks(report_to: list[str] | None, out: Path) -> list[Any]:
    """The --report-to callback (none without the flag); built before training starts,
    so a missing logger package stops the run before anything is written."""
    targets = [t.strip() for item in report_to or [] for t in item.split(",") if t.strip()]
    if not targets:
        return []
    from qkgeom.monitor.report_to import ReportTo

    return [ReportTo(targets, out)]


def train_cmd(
    preset: Annotated[str, typer.Option(
        help="smoke | small | paper: the model and run size; the flags below override "
             "it (table of presets: docs/training.md).")] = "small",
    out: unset(Path, "Run folder (default: runs/<preset>-s<seed>).") = None,
    data: unset(str, "sample (the embedded Wikipedia text) or a folder from `qkgeom data "
                      "prepare` (default: sample).") = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue the run in --out from its newest checkpoint "
                         "(same settings).")] = False,
    config: unset(Path, "YAML/JSON file of config overrides (applied before the flags).")
        = None,
    seed: unset(int, "Seed of init and data order (default: 0).") = None,
    steps: unset(int, _preset_help("Optimiser updates.", "steps")) = None,
    n_layer: unset(int, _preset_help("Number of layers (--depth is the same).",
                                      "model.n_layer"), "--n-layer", "--depth") = None,
    n_embd: unset(int, _preset_help("Model width.", "model.n_embd")) = None,
    n_head: unset(int, _preset_help("Attention heads per layer.", "model.n_head")) = None,
    block_size: unset(int, _preset_help("Context length (characters).", "model.block_size"))
        = None,
    batch_size: unset(int, _preset_help("Sequences per step.", "batch_size")) = None,
    lr: unset(float, _preset_help("Peak learning rate (warm-up, then cosine to 10 %).", "lr"))
        = None,
    qk_init: unset(str, "Init of W_Q, W_K: normal | orthogonal | tied (default: normal).")
        = None,
    probe_every: unset(int, _preset_help("Steps between probes (geometry measured on the "
                                          "probe set).", "probe_every")) = None,
    precision: unset(str, "auto (bf16 on CUDA, fp32 elsewhere) | fp32 | bf16 | fp16 "
                           "(default: auto).") = None,
    compile_: unset(bool, "torch.compile the training step (probes stay eager) (default: "
                           "no).", "--compile/--no-compile") = None,
    device: unset(str, f"{DEVICE_HELP} (default: auto).") = None,
    threads: unset(int, "torch CPU threads (default: torch's).") = None,
    key_control: unset(str, "Key-spectrum control: none | hold | shrink | sham | expand "
                             "(default: none).") = None,
    dose: unset(float, "shrink: cap PR_K at this share of the reference (the paired --set "
                        "key_control.reference run, else PR_K at step 0); expand: a multiple "
                        "(>= 1) (default: shrink 0.5, expand 2).", "--dose") = None,
    key_control_scope: unset(str, "Key control per layer | head (default: layer).") = None,
    key_control_level: unset(str, "Key control of the keys' spectrum on the layer's inputs "
                                   "(token) or of W_K's (weight) (default: token).") = None,
    set_: unset(list[str], "Any config key, dotted, repeatable (applied last): --set "
                            "model.dropout=0.1 --set eval_every=50.", "--set") = None,
    report_to: unset(list[str], "Also log probes and losses to tensorboard "
                                 "(RUN/tensorboard/) and/or wandb; repeatable or "
                                 "comma-separated.") = None,
    progress_every: unset(int, "Output not a terminal (nohup, SLURM, CI): a progress line "
                                "every N steps (default: probe_every).") = None,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="Print nothing but warnings and errors.")] = False,
) -> None:
    """Train a char-level GPT and record Q/K geometry along the way."""
    import warnings

    from qkgeom.config import make_config, parse_dotted
    from qkgeom.launch import train

    if progress_every is not None and progress_every < 1:
        raise QKGeomError(f"--progress-every must be >= 1, got {progress_every}")
    flags = train_overrides(
        data=data, seed=seed, steps=steps, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        block_size=block_size, batch_size=batch_size, lr=lr, qk_init=qk_init,
        probe_every=probe_every, precision=precision, compile=compile_, device=device,
        threads=threads, key_control=key_control, dose=dose,
        key_control_scope=key_control_scope, key_control_level=key_control_level)
    overrides = read_config_file(config) if config is not None else {}
    for layer in (flags, parse_dotted(set_ or [])):  # file, then flags, then --set
        overrides = deep_merge(overrides, layer)
    fitted, note = fit_preset_to_steps(preset, overrides)
    cfg = make_config(preset, fitted)
    if note:  # once the config is valid: a refused one says only why
        warnings.warn(note, stacklevel=2)
    out = out or Path("runs") / f"{preset}-s{cfg.seed}"
    result = train(cfg, out, resume=resume, progress=not quiet,
                   callbacks=_report_callbacks(report_to, out), progress_every=progress_every)
    if quiet:
        return
    _show_metrics(result.out_dir, result.metrics, None, cfg.ref_step)
    final = result.log.dropna(subset=["val_loss"]).tail(1)
    if len(final):
        info(f"val loss {final['val_loss'].iloc[0]:.4f} at step {result.step}")
    info(f"run folder: {result.out_dir}")


def show(
    run: Annotated[Path, typer.Argument(help="Run folder (trained, swept or monitored).")],
    step: Annotated[int | None, typer.Option(
        help="Probe step (default: the last).", show_default=False)] = None,
    fmt: Format = "table",
) -> None:
    """A run's health (alerts, collapse, losses, largest logit per layer), then per-layer
    PR_Q, PR_K, contrast, pr_qk and attention entropy at one probe step."""
    from qkgeom.analysis.health import health_lines, run_health
    from qkgeom.runs import CONFIG, load_config, read_metrics

    check_format(fmt)
    metrics = read_metrics(run)  # a missing run or table: one line naming it
    ref = load_config(run).ref_step if (run / CONFIG).exists() else None
    health = run_health(run)
    if fmt == "table":  # health first: whether the run is well before what its geometry did
        from qkgeom.ui import print_lines

        print_lines(health_lines(health))
    _show_metrics(run, metrics, step, ref, fmt,
                  {"health": health.record(), "losses": health.losses})


def register(app: typer.Typer) -> None:
    """Add ``train`` and ``show`` to the ``qkgeom`` app."""
    app.command("train")(train_cmd)
    app.command("show")(show)
