"""``qkgeom`` command line: subcommands only; parse, validate, call the API, print.

Exit codes: 0 done, 2 bad input (one line on stderr, no traceback), 3 diverged,
130 interrupted.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from qkgeom.cli_monitor import register as register_monitor
from qkgeom.cli_pretrained import register as register_pretrained
from qkgeom.errors import QKGeomError

if TYPE_CHECKING:
    import pandas as pd

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
    precision: Annotated[str | None, typer.Option(
        help="auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16")] = None,
    compile_: Annotated[bool | None, typer.Option(
        "--compile/--no-compile", help="torch.compile the training step (probes stay eager).",
        show_default=False)] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N | mps")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (0 = default).")] = None,
    key_control: Annotated[str | None, typer.Option(
        help="Key-spectrum control: none | hold | shrink | expand (SPEC §4).")] = None,
    shrink_to: Annotated[float | None, typer.Option(
        help="shrink: final PR_K target as a share of PR_K at step 0.")] = None,
    key_control_scope: Annotated[str | None, typer.Option(help="layer | head")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Dotted override, repeatable: --set model.dropout=0.1")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Train a char-level GPT and record Q/K geometry along the way."""
    from qkgeom.config import deep_merge, make_config, parse_dotted
    from qkgeom.training import train

    overrides: dict[str, Any] = {}
    if config is not None:
        overrides = deep_merge(overrides, _read_config_file(config))
    overrides = deep_merge(overrides, _train_overrides(
        data=data, seed=seed, steps=steps, depth=depth, n_embd=n_embd, n_head=n_head,
        block_size=block_size, batch_size=batch_size, lr=lr, qk_init=qk_init,
        probe_every=probe_every, precision=precision, compile=compile_, device=device,
        threads=threads, key_control=key_control, shrink_to=shrink_to,
        key_control_scope=key_control_scope))
    overrides = deep_merge(overrides, parse_dotted(set_ or []))
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
        from qkgeom.training import load_run_config

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


sweep_app = typer.Typer(no_args_is_help=True, help="Run and inspect grids of training runs.")
reproduce_app = typer.Typer(no_args_is_help=True, help="The paper's experiments, end to end.")
app.add_typer(sweep_app, name="sweep")
app.add_typer(reproduce_app, name="reproduce")

Workers = Annotated[int | None, typer.Option(
    help="Runs trained at once (default: one single-threaded run per CPU on CPU grids, "
         "one at a time on GPU).")]
Backend = Annotated[str, typer.Option(help="local | ray")]
Address = Annotated[str | None, typer.Option(
    help="Ray cluster address: auto or host:port (backend ray).")]
Threads = Annotated[int | None, typer.Option(
    help="torch threads per run (default: CPUs / workers).")]


@sweep_app.command("run")
def sweep_run(
    grid: Annotated[Path, typer.Argument(help="Grid file (YAML): preset, base, axes.")],
    out: Annotated[Path | None, typer.Option(help="Sweep folder (default sweeps/<name>).")] = None,
    workers: Workers = None,
    backend: Backend = "local",
    address: Address = None,
    threads: Threads = None,
    retry_failed: Annotated[bool, typer.Option(help="Train failed runs again.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress view.")] = False,
) -> None:
    """Train every run of a grid (resumable: done runs are skipped, interrupted ones resume)."""
    from qkgeom.experiments import load_grid, run_sweep
    from qkgeom.experiments.runner import available_cpus

    spec = load_grid(grid)
    out = out or Path("sweeps") / spec.name
    if workers is None:
        on_cpu = spec.expand()[0].config.device == "cpu"
        workers = available_cpus() if on_cpu else 1
    summary = run_sweep(spec, out, workers=workers, backend=backend, address=address,
                        threads_per_run=threads, progress=not quiet, retry_failed=retry_failed)
    _print_summary(summary, out)


def _print_summary(summary: object, out: Path) -> None:
    typer.echo(f"{summary}")
    typer.echo(f"sweep folder: {out}")


@sweep_app.command("status")
def sweep_status_cmd(
    sweep: Annotated[Path, typer.Argument(help="Sweep folder.")],
) -> None:
    """done / running / failed / diverged / pending per run."""
    from qkgeom.experiments import sweep_status

    _render_frame(sweep_status(sweep), f"{sweep} — runs")


def _render_frame(frame: pd.DataFrame, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in frame.columns:
        table.add_column(str(col))
    for row in frame.itertuples(index=False):
        table.add_row(*("" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
                        for v in row))
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 200))
    console.print(table)


def _report(sweep: Path, out: Path | None) -> None:
    from qkgeom.analysis import claims_table, write_report

    path = write_report(sweep, out)
    claims = claims_table(sweep)
    cols = ["claim_id", "claim", "level", "from", "measured", "p_value", "verdict"]
    _render_frame(claims[cols], "claims (verdicts computed from the numbers; see report.md)")
    excluded = claims.attrs.get("excluded")
    if excluded is not None and len(excluded):
        typer.echo(f"{len(excluded)} run(s) left out (diverged/failed/unfinished): see the report")
    typer.echo(f"report: {path}")


register_pretrained(app)  # `analyze` and `export` (E4, qkgeom.cli_pretrained)
register_monitor(app)  # `watch` (live view of a training run, qkgeom.cli_monitor)


@app.command("report")
def report_cmd(
    sweep: Annotated[Path, typer.Argument(help="Sweep folder.")],
    out: Annotated[Path | None, typer.Option(help="Report folder (default SWEEP/report).")] = None,
) -> None:
    """Figures + report.md/report.html opening with the claims table."""
    if (sweep / "analysis.json").is_file():  # a checkpoint analysis (qkgeom analyze): E4
        from qkgeom.pretrained.report import write_e4_report

        typer.echo(f"report: {write_e4_report(sweep, out)}")
        return
    if not (sweep / "sweep.json").is_file() and not (sweep / "runs").is_dir():
        raise QKGeomError(f"{sweep}: not a sweep folder (no sweep.json); run `qkgeom sweep run` "
                          "or `qkgeom reproduce` first")
    _report(sweep, out)


Preset = Annotated[str, typer.Option(help="smoke | demo | paper")]
Data = Annotated[str, typer.Option(help="Prepared data (default: embedded sample).")]
Device = Annotated[str | None, typer.Option(help="cpu | cuda | ... for every run")]
Quiet = Annotated[bool, typer.Option(help="No progress view.")]


def _reproduce(experiment: str, preset: str, data: str, out: Path | None,
               overrides: dict[str, Any], *, workers: int | None, backend: str,
               address: str | None, threads: int | None, quiet: bool) -> None:
    """Run one of the paper's grids (``qkgeom.experiments.reproduce_<experiment>``) into
    ``out`` (default ``sweeps/<experiment>-<preset>``), then print the summary and report."""
    import qkgeom.experiments as experiments

    out = out or Path("sweeps") / f"{experiment}-{preset}"
    run = getattr(experiments, f"reproduce_{experiment}")
    summary = run(preset, out, data, workers=workers, backend=backend, address=address,
                  threads_per_run=threads, progress=not quiet, overrides=overrides or None)
    _print_summary(summary, out)
    _report(out, None)


@reproduce_app.command("e1")
def reproduce_e1_cmd(
    preset: Preset = "demo",
    data: Data = "",
    out: Annotated[Path | None, typer.Option(help="Sweep folder (default sweeps/e1-<preset>).")] = None,
    workers: Workers = None,
    backend: Backend = "local",
    address: Address = None,
    threads: Threads = None,
    device: Device = None,
    quiet: Quiet = False,
) -> None:
    """E1 + E2: depths {4,6,8} x inits {normal,orthogonal,tied} x seeds, then the report."""
    _reproduce("e1", preset, data, out, {"device": device} if device else {}, workers=workers,
               backend=backend, address=address, threads=threads, quiet=quiet)


@reproduce_app.command("e3")
def reproduce_e3_cmd(
    preset: Preset = "demo",
    data: Data = "",
    out: Annotated[Path | None, typer.Option(help="Sweep folder (default sweeps/e3-<preset>).")] = None,
    shrink_to: Annotated[float | None, typer.Option(
        help="shrink: final PR_K target as a share of step 0's (default 0.5).")] = None,
    scope: Annotated[str | None, typer.Option(
        "--key-control-scope", help="layer | head (default layer).")] = None,
    workers: Workers = None,
    backend: Backend = "local",
    address: Address = None,
    threads: Threads = None,
    device: Device = None,
    quiet: Quiet = False,
) -> None:
    """E3: seeds x key control {none, hold, shrink}, paired by seed, then the report."""
    overrides = {k: v for k, v in (("device", device), ("shrink_to", shrink_to),
                                   ("key_control_scope", scope)) if v is not None}
    _reproduce("e3", preset, data, out, overrides, workers=workers, backend=backend,
               address=address, threads=threads, quiet=quiet)


def main(argv: list[str] | None = None) -> None:
    """Entry point: turn user errors into one line and an exit code.

    Typer's standalone mode already reports usage errors (unknown option, bad choice) as a
    short message with exit code 2; errors the user can fix raised from inside a command
    (:class:`QKGeomError`) are caught here.
    """
    import warnings

    from qkgeom.errors import DivergedError, StorageError

    # Warnings (e.g. "torn checkpoint, falling back") as one line, not file:line + source.
    warnings.formatwarning = lambda message, *_, **__: f"qkgeom: warning: {message}\n"
    try:
        app(args=argv, standalone_mode=True)
    except DivergedError as err:
        typer.echo(f"qkgeom: {err}", err=True)
        sys.exit(err.exit_code)
    except QKGeomError as err:
        typer.echo(f"qkgeom: error: {err}", err=True)
        sys.exit(err.exit_code)
    except OSError as err:  # a folder qkgeom may not create (read-only, full disk)
        if err.errno not in StorageError.ERRNOS:
            raise
        typer.echo(f"qkgeom: error: {StorageError.of(err.filename or '?', err)}", err=True)
        sys.exit(StorageError.exit_code)
    except KeyboardInterrupt:
        typer.echo("qkgeom: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
