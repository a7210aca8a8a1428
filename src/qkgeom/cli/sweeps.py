"""``qkgeom sweep run|status``, ``qkgeom reproduce EXPERIMENT`` and ``qkgeom report``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from qkgeom.cli.output import (
    ClaimsFormat,
    StatusFormat,
    check_format,
    info,
    records,
    unset,
    write_csv,
    write_json,
)
from qkgeom.config import DEVICE_HELP
from qkgeom.errors import QKGeomError

if TYPE_CHECKING:
    import pandas as pd

Workers = unset(int, "Runs trained at once (default: one single-threaded run per CPU on CPU "
                     "grids, --runs-per-gpu per GPU on CUDA grids).")
Backend = Annotated[str, typer.Option(help="local (processes here) | ray (a Ray cluster).")]
Address = unset(str, "Ray cluster address: auto or host:port (backend ray).")
Threads = unset(int, "torch threads per run (default: CPUs / workers).")
Retries = Annotated[int, typer.Option(
    help="Backend ray: start a run again, up to N times, when its worker dies (it resumes "
         "from its checkpoint).")]
RunsPerGpu = Annotated[str, typer.Option(
    help="CUDA grids: runs sharing one GPU (a number, or auto: measured once per sweep "
         "folder, see docs/speed.md).")]
# its help: generated from the registry of experiments (_generated_help)
Preset = Annotated[str, typer.Option(help="The experiment's size: one of its presets.")]
Data = Annotated[str, typer.Option(
    help="sample (the embedded Wikipedia text) or a prepared data folder (default: "
         "sample).", show_default=False)]
Device = unset(str, f"{DEVICE_HELP}, for every run (default: auto).")
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress view.")]
ResultFolder = Annotated[Path, typer.Argument(
    help="A sweep folder (E1/E2, E3), a checkpoint analysis folder from `qkgeom analyze` "
         "(E4), an E4 set from `qkgeom reproduce e4` (one analysis per seed) or one run "
         "folder (trained or monitored).")]


def _sweep(train: Any, grid: Any, out: Path, device: str | None, report_after: bool = False,
           **options: Any) -> None:
    """``train(grid, out, **options)`` after :func:`warn_long_sweep`, then print the sweep's
    summary (then its report); exit 1 when a run failed (a diverged run is a result, not a
    failure)."""
    warn_long_sweep([r.config for r in unfinished(out, grid.expand())], device)
    summary = train(grid, out, **options)
    typer.echo(f"{summary}")
    typer.echo(f"sweep folder: {out}")
    if report_after:
        report(out, None)
    if summary.counts.get("failed"):
        raise typer.Exit(1)


def report(folder: Path, out: Path | None, fmt: str = "table", *,
           calibration: Path | None = None, also: list[Path] | None = None) -> None:
    """Write the report of any result folder and print its claims table (``fmt``);
    ``calibration``/``also``: a stability sweep's cross-size alert table."""
    import pandas as pd

    from qkgeom.analysis import excluded_count, summary_line, write_report
    from qkgeom.analysis.e3.claims import raw_entropy_lines
    from qkgeom.analysis.health import health_lines, run_health
    from qkgeom.analysis.kit import descriptive_reason
    from qkgeom.runs import is_run_folder
    from qkgeom.runs.sweep import sweep_experiment
    from qkgeom.ui import print_lines, render_frame

    path = write_report(folder, out, calibration=calibration, also=also or ())
    html = path.with_suffix(".html")
    # The report wrote its claims: read them back rather than analyse the folder twice.
    claims = pd.read_csv(path.parent / "claims.csv", keep_default_na=False, na_values=[""])
    excluded = excluded_count(path.parent)
    health = run_health(folder) if is_run_folder(folder) else None  # one run: health first
    if fmt == "json":
        write_json({"folder": str(folder), "report": str(path),
                    "html": str(html) if html.is_file() else None, "excluded": excluded,
                    **({"health": health.record()} if health else {}),
                    "claims": records(claims)})
        return
    if fmt == "csv":
        write_csv(claims)
        info(f"report: {path}", fmt)
        return
    if sweep_experiment(folder) == "stability":
        _stability_summary(path, html)
        return
    every_row = claims
    if health is not None:  # one run: its health, then the rows it measured
        print_lines(health_lines(health))
        claims = claims[pd.to_numeric(claims["n"], errors="coerce").fillna(0) > 0]
    shown = terminal_claims(claims)
    descriptive = descriptive_reason(claims)
    p_note = ("p (adjusted) = the p the verdict reads: exact sign-flip p, Holm-adjusted "
              "within the row's family (a family tested each at α keeps its raw p; the raw "
              "p is p_value in claims.csv)" if "p (adjusted)" in shown
              else "p (sign-flip) = exact one-sided sign-flip p-value")
    render_frame(shown, "claims (measured only: too few units for a verdict; see report.md)"
                 if descriptive else "claims (verdicts computed from the numbers; see "
                 "report.md)",
                 [f"{TERMINAL_CLAIMS['measured']} = units with the predicted sign / units (a unit is a run, "
                  "or a seed: docs/protocols.md)", p_note,
                  *(["role: the primary row decides the claim, secondary rows are "
                     "descriptive"] if "role" in shown else [])],
                 group=[c for c in ("id", "claim") if c in shown])
    left_out = f"{excluded} run(s) left out (diverged/failed/unfinished): see the report"
    for line in (descriptive, *raw_entropy_lines(claims), _not_recorded(every_row),
                 left_out if excluded else "",
                 summary_line(path.parent), f"report: {path}",
                 f"report (HTML): {html}" if html.is_file() else ""):
        if line:
            typer.echo(line)


def _stability_summary(path: Path, html: Path) -> None:
    """A stability report's terminal summary (``qkgeom.analysis.stability.summary``)."""
    from qkgeom.analysis import summary_line
    from qkgeom.analysis.stability.summary import terminal_summary
    from qkgeom.ui import render_frame

    s = terminal_summary(path.parent)
    render_frame(s.table, s.title, s.notes)
    for line in (*s.lines, summary_line(path.parent), f"report: {path}",
                 f"report (HTML): {html}" if html.is_file() else ""):
        if line:
            typer.echo(line)


#: The terminal claims table: claims.csv column -> its header (words, not field names).
TERMINAL_CLAIMS = {"setting": "setting", "claim_id": "id", "claim": "claim", "role": "role",
                   "level": "level", "from": "from", "statistic": "statistic",
                   "measured": "sign k/n", "p_adj": "p (adjusted)", "p_value": "p (sign-flip)",
                   "verdict": "verdict", "verdict_gate_p1": "verdict, protocol-1 gate (E3)"}


def terminal_claims(claims: pd.DataFrame) -> pd.DataFrame:
    """The claims table as the terminal shows it: the columns of :data:`TERMINAL_CLAIMS`
    under their headers (the Holm p where there is one, else the sign-flip p), without the
    verdict when the table is descriptive (too few units for any verdict)."""
    from qkgeom.analysis.kit import descriptive_reason

    cols = [c for c in TERMINAL_CLAIMS if c in claims
            and not (c.startswith("verdict") and descriptive_reason(claims))
            and not (c == "p_value" and "p_adj" in claims)]  # the Holm p when there is one
    if "layer" in claims:  # E1's per-layer rows: in report.md and claims.csv, not here
        claims = claims[claims["layer"].isna()]
    return claims[cols].rename(columns=TERMINAL_CLAIMS)


def _not_recorded(claims: pd.DataFrame) -> str:
    """One line for the rows that measured nothing because their metrics were not
    recorded, naming the setting that records them ("" when there are none)."""
    from qkgeom.analysis.kit import RECORD_ALL, reasons

    if "reason" not in claims:
        return ""
    reason = reasons(claims)
    rows = reason.str.startswith("not recorded")
    if not rows.any():
        return ""
    names = sorted({m.strip() for r in reason[rows]
                    for m in r.removeprefix("not recorded:").split("(")[0].split(",")})
    return (f"{int(rows.sum())} claim row(s) measured nothing: the run(s) did not record "
            f"{', '.join(names)}; {RECORD_ALL} records every metric")


def unfinished(out: Path, runs: list[Any]) -> list[Any]:
    """The runs of a sweep (``RunSpec``s) that ``out`` does not hold finished yet: what a
    ``sweep run`` or ``reproduce`` into ``out`` would still train."""
    from qkgeom.runs import finished_state, read_status
    from qkgeom.runs.sweep import run_dir

    return [r for r in runs if finished_state(read_status(run_dir(out, r.run_id))) is None]


def warn_long_sweep(configs: list[Any], device: str | None) -> None:
    """One warning when the runs of a sweep still to train would take long on this
    machine's CPU (no GPU found, or ``cpu`` asked for): the sum of their estimates."""
    import warnings

    from qkgeom.config import detect_device
    from qkgeom.training.resources import LONG_CPU_S, cpu_seconds, duration

    names = {device or c.device for c in configs}
    on_cpu = all((detect_device() if n == "auto" else n) == "cpu" for n in names)
    if not configs or not on_cpu:
        return
    total = sum(cpu_seconds(c) for c in configs)
    if total > LONG_CPU_S:
        warnings.warn(f"the {len(configs)} runs of this sweep to train will take at least "
                      f"{duration(total)} of CPU time on this machine (no GPU in use); train "
                      "on a GPU (--device auto finds one), or choose a smaller --preset",
                      stacklevel=2)


def sweep_run(
    grid: Annotated[Path, typer.Argument(help="Grid file (YAML): preset, base, axes.")],
    out: unset(Path, "Sweep folder (default: sweeps/<name>).") = None,
    workers: Workers = None,
    backend: Backend = "local",
    address: Address = None,
    threads: Threads = None,
    retry_failed: Annotated[bool, typer.Option(
        "--retry-failed", help="Train failed runs again.")] = False,
    retries: Retries = 0,
    runs_per_gpu: RunsPerGpu = "1",
    quiet: Quiet = False,
) -> None:
    """Train every run of a grid (resumable: done runs are skipped, interrupted ones resume)."""
    from qkgeom.experiments import load_grid, run_sweep

    spec = load_grid(grid)
    _sweep(run_sweep, spec, out or Path("sweeps") / spec.folder_name, None, workers=workers,
           backend=backend, address=address, threads_per_run=threads, progress=not quiet,
           retry_failed=retry_failed, retries=retries, runs_per_gpu=runs_per_gpu)


def sweep_status_cmd(sweep: Annotated[Path, typer.Argument(help="Sweep folder.")],
                     fmt: StatusFormat = "table") -> None:
    """done / running / interrupted / failed / diverged / pending per run."""
    from qkgeom.experiments import sweep_status
    from qkgeom.ui import render_frame

    status = sweep_status(sweep)
    if check_format(fmt) == "json":
        write_json({"sweep": str(sweep), "runs": records(status)})
    elif fmt == "csv":
        write_csv(status)
    else:
        # for people the run id carries the axes; the error column only when a run has one
        shown = status[["run_id", "state", "step", "steps",
                        *(["error"] if status["error"].notna().any() else [])]]
        render_frame(shown, f"{sweep} — runs",
                     [f"{n} {state}" for state, n in status["state"].value_counts().items()])


def report_cmd(
    folder: ResultFolder,
    out: unset(Path, "Report folder (default: FOLDER/report).") = None,
    fmt: ClaimsFormat = "table",
    calibration: unset(Path, "Stability: the calibrate sweep whose thresholds the cross-size "
                             "alert table uses (a transfer sweep finds "
                             "stability-calibrate beside it).") = None,
    also: unset(list[Path], "Stability: another sweep or Hugging Face trial folder the "
                            "cross-size alert table reads, repeatable (a transfer sweep "
                            "reads stability-demo, stability-lab and alerts-hf beside "
                            "it).") = None,
) -> None:
    """Figures + report.md/report.html of a sweep, analysis or run folder, opening with
    the claims table (verdicts computed from the numbers)."""
    report(folder, out, check_format(fmt), calibration=calibration, also=also)


def reproduce_cmd(
    experiment: Annotated[str, typer.Argument(
        help="An experiment (the list is generated from qkgeom.experiments.EXPERIMENTS).")],
    preset: Preset = "demo",
    data: Data = "",
    out: unset(Path, "Sweep folder (default: sweeps/<experiment>-<preset>).") = None,
    workers: Workers = None,
    backend: Backend = "local",
    address: Address = None,
    threads: Threads = None,
    device: Device = None,
    set_: unset(list[str], "Dotted config override for every run, repeatable: --set "
                           "key_control.scope=head", "--set") = None,
    model: unset(str, "e4: a hub id or local HF folders analysed instead of training a run.")
        = None,
    revisions: unset(str, "e4 with --model: comma-separated revisions (step0,step512,...).")
        = None,
    text: unset(str, "e4: the text analysed (default: sample, its held-out split first).")
        = None,
    tokens: unset(int, "e4: text tokens analysed per checkpoint (default: the preset's).")
        = None,
    retries: Retries = 0,
    runs_per_gpu: RunsPerGpu = "1",
    quiet: Quiet = False,
) -> None:
    """One of the paper's experiments end to end (resumable), then the report."""
    from qkgeom.config import deep_merge, parse_dotted
    from qkgeom.experiments import E4
    from qkgeom.experiments import experiment as find

    exp = find(experiment)
    sets = parse_dotted(set_ or [])
    if isinstance(exp, E4):  # train and analyse (or analyse --model), then summarise
        from qkgeom.cli.checkpoints import split_revisions, summarise, summarise_set
        from qkgeom.runs.family import is_e4_set
        from qkgeom.training import resolve_device

        resolve_device(device or "auto")  # a bad --device fails before any work
        folder = exp.run(preset, out, data=data, model=model,
                         revisions=split_revisions(revisions), text=text, tokens=tokens,
                         device=device, progress=not quiet, overrides=sets or None)
        summarise_set(folder) if is_e4_set(folder) else summarise(folder)
        report(folder, None)
        return
    if any(v is not None for v in (model, revisions, text, tokens)):
        raise QKGeomError("--model, --revisions, --text and --tokens are for e4")
    grid = exp.grid(preset, data, deep_merge({"device": device} if device else {}, sets)
                    or None)
    _sweep(exp.run, grid, out or exp.default_out(preset), device, report_after=True,
           workers=workers, backend=backend, address=address, threads_per_run=threads,
           progress=not quiet, retries=retries, runs_per_gpu=runs_per_gpu)


def _generated_help() -> dict[str, str]:
    """``reproduce``'s experiment and preset help, from the registry of experiments."""
    from qkgeom.experiments import reproduce_help

    return reproduce_help()


reproduce_cmd.generated_help = _generated_help  # type: ignore[attr-defined]


def register(app: typer.Typer) -> None:
    """Add ``sweep run|status``, ``report`` and ``reproduce`` to the ``qkgeom`` app."""
    sweep_app = typer.Typer(no_args_is_help=True, help="Run and inspect grids of training runs.")
    app.add_typer(sweep_app, name="sweep")
    sweep_app.command("run")(sweep_run)
    sweep_app.command("status")(sweep_status_cmd)
    app.command("report")(report_cmd)
    app.command("reproduce")(reproduce_cmd)
