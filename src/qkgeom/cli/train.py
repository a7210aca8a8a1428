"""``qkgeom train`` and ``qkgeom show``: one run, and its per-layer table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from qkgeom.errors import QKGeomError

# CLI flag -> dotted config key (flags left None keep the preset's value).
_FLAG_KEYS = {"depth": "model.n_layer", "n_embd": "model.n_embd", "n_head": "model.n_head",
              "block_size": "model.block_size", "qk_init": "model.qk_init",
              "key_control": "key_control.mode", "dose": "key_control.dose",
              "key_control_scope": "key_control.scope"}


def train_overrides(**flags: Any) -> dict[str, Any]:
    """Nested config overrides from CLI flags; None = not given."""
    out: dict[str, Any] = {}
    for name, value in flags.items():
        if value is None:
            continue
        *parents, leaf = _FLAG_KEYS.get(name, name).split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML/JSON mapping of config overrides, or a one-line error."""
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QKGeomError(f"{path}: config file not found") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise QKGeomError(f"{path}: not valid YAML/JSON ({type(err).__name__})") from None
    if not isinstance(loaded, dict):
        raise QKGeomError(f"{path}: a config file must be a mapping of keys to values")
    return loaded


def show_run(run: Path, step: int | None) -> None:
    """Print the per-layer table of a run folder at ``step`` (default: its last probe)."""
    from qkgeom.analysis.tables import layer_table
    from qkgeom.runs import CONFIG, METRICS, load_config, read_metrics
    from qkgeom.ui import render_layers

    metrics = read_metrics(run)
    if metrics is None:
        raise QKGeomError(f"{run / METRICS}: not found; is {run} a qkgeom run folder?")
    ref = load_config(run).ref_step if (run / CONFIG).exists() else None
    try:
        at, table = layer_table(metrics, step, ref)
    except ValueError as err:
        raise QKGeomError(f"{run / METRICS}: {err}") from None
    render_layers(table, f"{run} — per-layer Q/K geometry at step {at}")


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train_cmd(
        preset: Annotated[str, typer.Option(help="smoke | demo | paper; flags override it.")]
            = "demo",
        out: Annotated[Path | None, typer.Option(
            help="Run folder (default runs/<preset>-s<seed>).")] = None,
        data: Annotated[str | None, typer.Option(
            help="Prepared data folder (default: the embedded Wikipedia sample).")] = None,
        resume: Annotated[bool, typer.Option(help="Continue the run in --out.")] = False,
        config: Annotated[Path | None, typer.Option(
            help="YAML/JSON file of config overrides.")] = None,
        seed: Annotated[int | None, typer.Option()] = None,
        steps: Annotated[int | None, typer.Option()] = None,
        depth: Annotated[int | None, typer.Option(help="Number of layers.")] = None,
        n_embd: Annotated[int | None, typer.Option()] = None,
        n_head: Annotated[int | None, typer.Option()] = None,
        block_size: Annotated[int | None, typer.Option()] = None,
        batch_size: Annotated[int | None, typer.Option()] = None,
        lr: Annotated[float | None, typer.Option()] = None,
        qk_init: Annotated[str | None, typer.Option(help="normal | orthogonal | tied")] = None,
        probe_every: Annotated[int | None, typer.Option()] = None,
        precision: Annotated[str | None, typer.Option(
            help="auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16")] = None,
        compile_: Annotated[bool | None, typer.Option(
            "--compile/--no-compile", help="torch.compile the training step (probes stay "
            "eager).", show_default=False)] = None,
        device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N | mps")] = None,
        threads: Annotated[int | None, typer.Option(
            help="torch CPU threads (0 = default).")] = None,
        key_control: Annotated[str | None, typer.Option(
            help="Key-spectrum control: none | hold | shrink | sham | expand.")] = None,
        dose: Annotated[float | None, typer.Option(
            "--dose", "--shrink-to", help="shrink: cap PR_K at this share of the reference "
            "(the paired --set key_control.reference run, else PR_K at step 0); expand: a "
            "multiple (>= 1).")] = None,
        key_control_scope: Annotated[str | None, typer.Option(help="layer | head")] = None,
        set_: Annotated[list[str] | None, typer.Option(
            "--set", help="Dotted override, repeatable: --set model.dropout=0.1")] = None,
        quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    ) -> None:
        """Train a char-level GPT and record Q/K geometry along the way."""
        from qkgeom.config import deep_merge, make_config, parse_dotted
        from qkgeom.launch import train

        overrides: dict[str, Any] = {}
        if config is not None:
            overrides = deep_merge(overrides, read_config_file(config))
        overrides = deep_merge(overrides, train_overrides(
            data=data, seed=seed, steps=steps, depth=depth, n_embd=n_embd, n_head=n_head,
            block_size=block_size, batch_size=batch_size, lr=lr, qk_init=qk_init,
            probe_every=probe_every, precision=precision, compile=compile_, device=device,
            threads=threads, key_control=key_control, dose=dose,
            key_control_scope=key_control_scope))
        overrides = deep_merge(overrides, parse_dotted(set_ or []))
        cfg = make_config(preset, overrides)
        out = out or Path("runs") / f"{preset}-s{cfg.seed}"
        result = train(cfg, out, resume=resume, progress=not quiet)
        show_run(result.out_dir, None)
        final = result.log.dropna(subset=["val_loss"]).tail(1)
        if len(final):
            typer.echo(f"val loss {final['val_loss'].iloc[0]:.4f} at step {result.step}")
        typer.echo(f"run folder: {result.out_dir}")

    @app.command("show")
    def show(
        run: Annotated[Path, typer.Argument(help="Run folder.")],
        step: Annotated[int | None, typer.Option(
            help="Probe step (default: the last).")] = None,
    ) -> None:
        """Per-layer PR_Q, PR_K, contrast, pr_qk and attention entropy at one probe step."""
        show_run(run, step)
