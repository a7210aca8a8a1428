"""``qkgeom sweep run|status``, ``qkgeom reproduce EXPERIMENT`` and ``qkgeom report``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from qkgeom.errors import QKGeomError

Workers = Annotated[int | None, typer.Option(
    help="Runs trained at once (default: one single-threaded run per CPU on CPU grids, "
         "--runs-per-gpu per GPU on CUDA grids).")]
Backend = Annotated[str, typer.Option(help="local | ray")]
Address = Annotated[str | None, typer.Option(
    help="Ray cluster address: auto or host:port (backend ray).")]
Threads = Annotated[int | None, typer.Option(
    help="torch threads per run (default: CPUs / workers).")]
Retries = Annotated[int, typer.Option(
    help="Backend ray: start a run again, up to N times, when its worker dies (it resumes "
         "from its checkpoint).")]
RunsPerGpu = Annotated[str, typer.Option(
    help="CUDA grids: runs sharing one GPU (a number, or auto: measured once per sweep "
         "folder, see docs/speed.md).")]
Preset = Annotated[str, typer.Option(help="smoke | demo | paper")]
Data = Annotated[str, typer.Option(help="Prepared data (default: embedded sample).")]
Device = Annotated[str | None, typer.Option(help="cpu | cuda | ... for every run")]
Quiet = Annotated[bool, typer.Option(help="No progress view.")]


def _print_summary(summary: object, out: Path) -> None:
    typer.echo(f"{summary}")
    typer.echo(f"sweep folder: {out}")


def report(folder: Path, out: Path | None) -> None:
    """Write the report of any result folder and print its claims table."""
    from qkgeom.analysis import claims_table, write_report
    from qkgeom.ui import render_frame

    path = write_report(folder, out)
    claims = claims_table(folder)
    cols = [c for c in ("claim_id", "claim", "level", "from", "measured", "p_value", "verdict")
            if c in claims]
    render_frame(claims[cols], "claims (verdicts computed from the numbers; see report.md)")
    excluded = claims.attrs.get("excluded")
    if excluded is not None and len(excluded):
        typer.echo(f"{len(excluded)} run(s) left out (diverged/failed/unfinished): see the report")
    typer.echo(f"report: {path}")


def _exit_if_failed(summary: Any) -> None:
    """Exit 1 when some run of the sweep failed (diverged runs are results, not failures)."""
    if summary.counts.get("failed"):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    sweep_app = typer.Typer(no_args_is_help=True, help="Run and inspect grids of training runs.")
    app.add_typer(sweep_app, name="sweep")

    @sweep_app.command("run")
    def sweep_run(
        grid: Annotated[Path, typer.Argument(help="Grid file (YAML): preset, base, axes.")],
        out: Annotated[Path | None, typer.Option(
            help="Sweep folder (default sweeps/<name>).")] = None,
        workers: Workers = None,
        backend: Backend = "local",
        address: Address = None,
        threads: Threads = None,
        retry_failed: Annotated[bool, typer.Option(help="Train failed runs again.")] = False,
        retries: Retries = 0,
        runs_per_gpu: RunsPerGpu = "1",
        quiet: Quiet = False,
    ) -> None:
        """Train every run of a grid (resumable: done runs are skipped, interrupted ones resume)."""
        from qkgeom.experiments import load_grid, run_sweep

        spec = load_grid(grid)
        out = out or Path("sweeps") / spec.folder_name
        summary = run_sweep(spec, out, workers=workers, backend=backend, address=address,
                            threads_per_run=threads, progress=not quiet,
                            retry_failed=retry_failed, retries=retries,
                            runs_per_gpu=runs_per_gpu)
        _print_summary(summary, out)
        _exit_if_failed(summary)

    @sweep_app.command("status")
    def sweep_status_cmd(sweep: Annotated[Path, typer.Argument(help="Sweep folder.")]) -> None:
        """done / running / failed / diverged / pending per run."""
        from qkgeom.experiments import sweep_status
        from qkgeom.ui import render_frame

        render_frame(sweep_status(sweep), f"{sweep} — runs")

    @app.command("report")
    def report_cmd(
        folder: Annotated[Path, typer.Argument(
            help="A sweep folder (E1/E2, E3), a checkpoint analysis folder (E4) or one run "
                 "folder (trained or monitored).")],
        out: Annotated[Path | None, typer.Option(
            help="Report folder (default FOLDER/report).")] = None,
    ) -> None:
        """Figures + report.md/report.html opening with the claims table."""
        report(folder, out)

    @app.command("reproduce")
    def reproduce_cmd(
        experiment: Annotated[str, typer.Argument(
            help="e1 (E1 + E2: depths {4,6,8} x Q/K inits x seeds) | e3 (E3: seeds x "
                 "key-control arms, paired by seed) | e4 (E4: a run with log-spaced "
                 "checkpoints, or --model, analysed as a checkpoint family)")],
        preset: Preset = "demo",
        data: Data = "",
        out: Annotated[Path | None, typer.Option(
            help="Sweep folder (default sweeps/<experiment>-<preset>).")] = None,
        workers: Workers = None,
        backend: Backend = "local",
        address: Address = None,
        threads: Threads = None,
        device: Device = None,
        set_: Annotated[list[str] | None, typer.Option(
            "--set", help="Dotted config override for every run, repeatable: "
                          "--set key_control.scope=head")] = None,
        model: Annotated[str | None, typer.Option(
            help="e4: a hub id or local HF folders analysed instead of training a run.")] = None,
        revisions: Annotated[str | None, typer.Option(
            help="e4 with --model: comma-separated revisions (step0,step512,...).")] = None,
        text: Annotated[str | None, typer.Option(
            help="e4: the text analysed (default: sample, its held-out split first).")] = None,
        tokens: Annotated[int | None, typer.Option(
            help="e4: text tokens analysed per checkpoint (default: the preset's).")] = None,
        retries: Retries = 0,
        runs_per_gpu: RunsPerGpu = "1",
        quiet: Quiet = False,
    ) -> None:
        """One of the paper's experiments end to end (resumable), then the report."""
        from qkgeom.config import deep_merge, parse_dotted
        from qkgeom.experiments import reproduce, reproduce_e4

        overrides = deep_merge({"device": device} if device else {}, parse_dotted(set_ or []))
        if experiment == "e4":
            from qkgeom.cli.checkpoints import split_revisions, summarise

            folder = reproduce_e4(preset, out, data=data, model=model,
                                  revisions=split_revisions(revisions), text=text,
                                  tokens=tokens, device=device, progress=not quiet,
                                  overrides=parse_dotted(set_ or []) or None)
            summarise(folder)
            report(folder, None)
            return
        if any(v is not None for v in (model, revisions, text, tokens)):
            raise QKGeomError("--model, --revisions, --text and --tokens are for e4")
        out = out or Path("sweeps") / f"{experiment}-{preset}"
        summary = reproduce(experiment, preset, out, data, workers=workers, backend=backend,
                            address=address, threads_per_run=threads, progress=not quiet,
                            overrides=overrides or None, retries=retries,
                            runs_per_gpu=runs_per_gpu)
        _print_summary(summary, out)
        report(out, None)
        _exit_if_failed(summary)
