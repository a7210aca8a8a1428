"""``qkgeom sweep run|status``, ``qkgeom reproduce e1|e3`` and ``qkgeom report``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

Workers = Annotated[int | None, typer.Option(
    help="Runs trained at once (default: one single-threaded run per CPU on CPU grids, "
         "one at a time on GPU).")]
Backend = Annotated[str, typer.Option(help="local | ray")]
Address = Annotated[str | None, typer.Option(
    help="Ray cluster address: auto or host:port (backend ray).")]
Threads = Annotated[int | None, typer.Option(
    help="torch threads per run (default: CPUs / workers).")]
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
    report(out, None)


def register(app: typer.Typer) -> None:
    sweep_app = typer.Typer(no_args_is_help=True, help="Run and inspect grids of training runs.")
    reproduce_app = typer.Typer(no_args_is_help=True, help="The paper's experiments, end to end.")
    app.add_typer(sweep_app, name="sweep")
    app.add_typer(reproduce_app, name="reproduce")

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
        quiet: Quiet = False,
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
                            threads_per_run=threads, progress=not quiet,
                            retry_failed=retry_failed)
        _print_summary(summary, out)

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

    @reproduce_app.command("e1")
    def reproduce_e1_cmd(
        preset: Preset = "demo",
        data: Data = "",
        out: Annotated[Path | None, typer.Option(
            help="Sweep folder (default sweeps/e1-<preset>).")] = None,
        workers: Workers = None,
        backend: Backend = "local",
        address: Address = None,
        threads: Threads = None,
        device: Device = None,
        quiet: Quiet = False,
    ) -> None:
        """E1 + E2: depths {4,6,8} x inits {normal,orthogonal,tied} x seeds, then the report."""
        _reproduce("e1", preset, data, out, {"device": device} if device else {},
                   workers=workers, backend=backend, address=address, threads=threads,
                   quiet=quiet)

    @reproduce_app.command("e3")
    def reproduce_e3_cmd(
        preset: Preset = "demo",
        data: Data = "",
        out: Annotated[Path | None, typer.Option(
            help="Sweep folder (default sweeps/e3-<preset>).")] = None,
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
        overrides: dict[str, Any] = {"device": device} if device else {}
        control = {k: v for k, v in (("shrink_to", shrink_to), ("scope", scope))
                   if v is not None}
        if control:
            overrides["key_control"] = control
        _reproduce("e3", preset, data, out, overrides, workers=workers, backend=backend,
                   address=address, threads=threads, quiet=quiet)
