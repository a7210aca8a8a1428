"""``qkgeom`` command line: subcommands only; parse, validate, call the API, print.

Exit codes: 0 done, 2 bad input (one line on stderr, no traceback), 3 diverged,
130 interrupted.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from qkgeom.errors import QKGeomError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Geometry of attention queries and keys.")
data_app = typer.Typer(no_args_is_help=True, help="Prepare corpora into token arrays.")
app.add_typer(data_app, name="data")


class Source(str, Enum):
    sample = "sample"
    wikitext_103 = "wikitext-103"
    text = "text"
    wikidump = "wikidump"


@data_app.command("prepare")
def data_prepare(
    dir: Annotated[Path, typer.Option("--dir", help="Output folder for the token arrays.")],
    source: Annotated[Source, typer.Option(help="Corpus to prepare.")] = Source.sample,
    path: Annotated[Path | None, typer.Option(
        help="Input: WikiText raw folder (omit to use the `datasets` copy), a text file or "
             "folder, or a Wikipedia *.xml.bz2 dump.")] = None,
) -> None:
    """Prepare a corpus as memory-mapped character tokens plus meta.json."""
    from qkgeom.data import load_prepared, prepare_data

    out = prepare_data(source.value, dir, path=path)
    data = load_prepared(out)
    sizes = ", ".join(f"{k} {len(getattr(data, k)):,}" for k in ("train", "val", "test"))
    typer.echo(f"prepared {source.value} into {out}: vocab {data.vocab.vocab_size}, "
               f"tokens {sizes}")


def _train_overrides(**flags: Any) -> dict[str, Any]:
    """Map CLI flags onto nested config keys; None = not given (keep the preset's)."""
    model_keys = {"depth": "n_layer", "n_embd": "n_embd", "n_head": "n_head",
                  "block_size": "block_size", "qk_init": "qk_init"}
    out: dict[str, Any] = {}
    for name, value in flags.items():
        if value is None:
            continue
        if name in model_keys:
            out.setdefault("model", {})[model_keys[name]] = value
        else:
            out[name] = value
    return out


def _deep_update(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
    return base


@app.command("train")
def train_cmd(
    preset: Annotated[str, typer.Option(help="smoke | demo | paper; flags override it.")] = "demo",
    out: Annotated[Path | None, typer.Option(help="Run folder (default runs/<preset>-s<seed>).")] = None,
    data: Annotated[str | None, typer.Option(
        help="Prepared data folder (default: the embedded Wikipedia sample).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in --out.")] = False,
    config: Annotated[Path | None, typer.Option(help="YAML/JSON file of config overrides.")] = None,
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
    precision: Annotated[str | None, typer.Option(help="fp32 | bf16 | fp16")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N | mps")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (0 = default).")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Dotted override, repeatable: --set model.dropout=0.1")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Train a char-level GPT and record Q/K geometry along the way."""
    from qkgeom.config import make_config, parse_dotted
    from qkgeom.train import train

    overrides: dict[str, Any] = {}
    if config is not None:
        overrides = _deep_update(overrides, _read_config_file(config))
    overrides = _deep_update(overrides, _train_overrides(
        data=data, seed=seed, steps=steps, depth=depth, n_embd=n_embd, n_head=n_head,
        block_size=block_size, batch_size=batch_size, lr=lr, qk_init=qk_init,
        probe_every=probe_every, precision=precision, device=device, threads=threads))
    overrides = _deep_update(overrides, parse_dotted(set_ or []))
    cfg = make_config(preset, overrides)
    out = out or Path("runs") / f"{preset}-s{cfg.seed}"
    result = train(cfg, out, resume=resume, progress=not quiet)
    _show(result.out_dir, None)
    final = result.log.dropna(subset=["val_loss"]).tail(1)
    if len(final):
        typer.echo(f"val loss {final['val_loss'].iloc[0]:.4f} at step {result.step}")
    typer.echo(f"run folder: {result.out_dir}")


def _read_config_file(path: Path) -> dict[str, Any]:
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


def _show(run: Path, step: int | None) -> None:
    import pandas as pd

    from qkgeom.report_table import layer_table, render

    path = run / "metrics.parquet"
    if not path.exists():
        raise QKGeomError(f"{path}: not found; is {run} a qkgeom run folder?")
    try:
        metrics = pd.read_parquet(path)
    except Exception as err:
        raise QKGeomError(f"{path}: unreadable Parquet ({type(err).__name__})") from None
    ref = None
    if (run / "config.json").exists():
        from qkgeom.train import load_run_config

        ref = load_run_config(run).ref_step
    try:
        at, table = layer_table(metrics, step, ref)
    except ValueError as err:
        raise QKGeomError(f"{path}: {err}") from None
    render(table, f"{run} — per-layer Q/K geometry at step {at}")


@app.command("show")
def show(
    run: Annotated[Path, typer.Argument(help="Run folder.")],
    step: Annotated[int | None, typer.Option(help="Probe step (default: the last).")] = None,
) -> None:
    """Per-layer PR_Q, PR_K, contrast, pr_qk and attention entropy at one probe step."""
    _show(run, step)


def main(argv: list[str] | None = None) -> None:
    """Entry point: turn user errors into one line and an exit code.

    Typer's standalone mode already reports usage errors (unknown option, bad choice) as a
    short message with exit code 2; errors the user can fix raised from inside a command
    (:class:`QKGeomError`) are caught here.
    """
    from qkgeom.errors import DivergedError

    try:
        app(args=argv, standalone_mode=True)
    except DivergedError as err:
        typer.echo(f"qkgeom: {err}", err=True)
        sys.exit(err.exit_code)
    except QKGeomError as err:
        typer.echo(f"qkgeom: error: {err}", err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        typer.echo("qkgeom: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
