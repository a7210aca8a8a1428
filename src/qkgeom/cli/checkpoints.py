"""``qkgeom analyze`` and ``qkgeom export``: checkpoint families (E4) and our runs as HF models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from qkgeom.cli.output import AnalysisFormat, check_format, info, records, show_layers, unset
from qkgeom.config import DEVICE_HELP
from qkgeom.errors import QKGeomError


def split_revisions(revisions: str | None) -> list[str] | None:
    if revisions is None:
        return None
    items = [r.strip() for r in revisions.split(",") if r.strip()]
    if not items:
        raise QKGeomError("--revisions is empty; give a comma-separated list like step0,step512")
    return items


def _default_out(models: list[str]) -> Path:
    name = models[0].rstrip("/").replace("/", "_") if len(models) == 1 else \
        (Path(models[0]).parent.name or "local")
    return Path("ckpt") / name


def _call_line(r: Any) -> str:
    lost = (f", {100 * r.share_lost:.0f} % of the gain lost"
            if r.call == "rise then fall" else "")
    return f"{r.call} (peak at step {int(r.peak_step)}{lost})"


def summarise_set(out: Path) -> None:
    """One line per seed of an E4 set: the regime call of each layer (primary contrast)."""
    from qkgeom.analysis.e4.report import load_set
    from qkgeom.analysis.e4.trends import PRIMARY

    for unit, a in load_set(out).items():
        t = a["trends"]
        t = t[t["metric"] == PRIMARY].sort_values("layer") if len(t) else t
        typer.echo(f"{unit}: " + "; ".join(f"layer {r.layer} {_call_line(r)}"
                                           for r in t.itertuples()))


def summarise(out: Path, fmt: str = "table") -> None:
    """Per-layer table of the last checkpoint in the trends, and the contrast trends
    (``fmt`` json: one object with both; csv: the per-layer table)."""
    from qkgeom.analysis.e4.report import load_analysis
    from qkgeom.analysis.e4.trends import PRIMARY
    from qkgeom.analysis.tables import layer_table

    analysis = load_analysis(out)
    metrics, ckpts, trends = analysis["metrics"], analysis["checkpoints"], analysis["trends"]
    last = ckpts[ckpts["in_trends"]].sort_values("step").iloc[-1]
    one = metrics[metrics["checkpoint"] == last["checkpoint"]]
    if "block" in one:
        one = one[one["block"] == -1]  # all tokens, not the bootstrap's token blocks
    _, table = layer_table(one)
    table = table[[c for c in table.columns if not c.startswith("Δ")]]
    dups = ckpts[ckpts["duplicate_of"].notna()]
    primary = trends[trends["metric"] == PRIMARY] if len(trends) else trends
    show_layers(table, f"{out} — {last['checkpoint']} (step {int(last['step'])}), "
                f"{int(last['tokens']):,} tokens at {last['tokens_per_s']:,.0f} tokens/s", fmt,
                {"folder": str(out), "checkpoint": str(last["checkpoint"]),
                 "step": int(last["step"]), "tokens": int(last["tokens"]),
                 "duplicates": records(dups[["checkpoint", "duplicate_of", "in_trends"]]),
                 "trends": records(primary)})
    if fmt != "table":
        return
    for r in dups.itertuples():
        typer.echo(f"duplicate: {r.checkpoint} serves the same Q/K weights as {r.duplicate_of}"
                   + ("" if not r.in_trends else " (kept)"))
    for r in primary.itertuples():
        typer.echo(f"layer {r.layer}: {PRIMARY} {_call_line(r)[:-1]}; ρ(step) {r.rho:+.2f})")


def analyze_cmd(
    models: Annotated[list[str], typer.Argument(
        help="HF hub id, local HF folders (ordered by step), or a qkgeom run folder.")],
    revisions: unset(str, "Comma-separated hub revisions (step0,step512,...), sub-folders of "
                          "a local folder, or steps of a run's checkpoints (default: main / "
                          "all).") = None,
    text: unset(str, "sample | wikitext-103[:split] | a UTF-8 file or folder (default: "
                     "sample; a qkgeom run folder: the run's own probe set).") = None,
    tokens: Annotated[int, typer.Option(help="Text tokens analysed per checkpoint.")]
        = 200_000,
    out: unset(Path, "Analysis folder (default: ckpt/<model>).") = None,
    seq_len: unset(int, "Window length (default: min(context, 512)).") = None,
    batch_size: unset(int, "Windows per forward (default: 8192 tokens' worth).") = None,
    qk_site: Annotated[str, typer.Option(
        help="pre-rotary | post-rotary: q/k for the token PRs (pre-rotary also records "
             "the post-rotary PRs of rotary models as *_post).")] = "pre-rotary",
    blocks: Annotated[int, typer.Option(
        help="Contiguous token blocks also measured on their own (the same at every "
             "checkpoint; for the E4 bootstrap); 1 = none.")] = 8,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "auto",
    keep_duplicates: Annotated[bool, typer.Option(
        "--keep-duplicates",
        help="Keep checkpoints with identical Q/K weights in the trend statistics.")]
        = False,
    tokenizer: unset(str, "Tokenizer to use (hub id or folder) if the checkpoints have none.")
        = None,
    logit_spectrum: Annotated[bool, typer.Option(
        "--logit-spectrum/--no-logit-spectrum",
        help="Measure pr_qk_token (the per-sequence logit spectrum).")] = True,
    trust_remote_code: Annotated[bool, typer.Option(
        "--trust-remote-code", help="Allow models with custom code from the hub.")]
        = False,
    fmt: AnalysisFormat = "table",
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="No progress bar; print only the result.")] = False,
    backend: Annotated[str, typer.Option(
        help="local | ray: where checkpoints are measured (ray: one task per checkpoint, "
             "each writing its own cache entry).")] = "local",
    workers: Annotated[int | None, typer.Option(
        help="Checkpoints measured at once (local: processes, default 1 = this one; "
             "ray: tasks in flight, default as many as the cluster runs).")] = None,
    address: Annotated[str | None, typer.Option(
        help="Ray cluster address: auto or host:port (backend ray; default: a local "
             "Ray on 127.0.0.1).")] = None,
    threads: Annotated[int, typer.Option(
        help="torch threads per worker (with --workers or --backend ray).")] = 1,
) -> None:
    """Token-level Q/K geometry of checkpoints (E4): cached per checkpoint, resumable;
    measured here one at a time, or spread over local processes or Ray workers."""
    from qkgeom.checkpoints.family import analyze_checkpoints
    from qkgeom.experiments.executors import make_executor
    from qkgeom.training import resolve_device

    check_format(fmt)
    if text not in (None, "sample"):  # a bad --text is named before the hub is tried
        from qkgeom.data.text import open_text

        open_text(text)
    device = str(resolve_device(device))
    executor = make_executor(backend, workers=workers, threads=threads, address=address,
                             device=device)
    folder = analyze_checkpoints(
        models, out or _default_out(models), revisions=split_revisions(revisions), text=text,
        max_tokens=tokens, seq_len=seq_len, batch_size=batch_size, qk_site=qk_site,
        dtype=dtype, device=device, keep_duplicates=keep_duplicates,
        tokenizer=tokenizer, logit_spectrum=logit_spectrum,
        trust_remote_code=trust_remote_code, blocks=blocks,
        progress=not quiet and fmt == "table", executor=executor)
    summarise(folder, fmt)
    info(f"analysis folder: {folder}  (report: qkgeom report {folder})", fmt)


def export_cmd(
    run: Annotated[Path, typer.Argument(help="Run folder.")],
    out: Annotated[Path, typer.Option(help="Output folder (GPT2LMHeadModel format).")],
    step: unset(int, "Checkpoint step (default: the newest).") = None,
) -> None:
    """Write a run's checkpoint as a Hugging Face GPT2LMHeadModel folder with a
    character tokenizer that truncates at the run's context."""
    from qkgeom.checkpoints.export import export_run
    from qkgeom.runs import CONFIG

    if not (run / CONFIG).is_file():
        raise QKGeomError(f"{run}: not a qkgeom run folder (no config.json)")
    typer.echo(f"exported: {export_run(run, out, step)}")


def register(app: typer.Typer) -> None:
    """Add ``analyze`` and ``export`` to the ``qkgeom`` app."""
    app.command("analyze")(analyze_cmd)
    app.command("export")(export_cmd)
