"""``qkgeom analyze`` and ``qkgeom export``: checkpoint families (E4) and our runs as HF models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qkgeom.errors import QKGeomError


def _split(revisions: str | None) -> list[str] | None:
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


def _summary(out: Path) -> None:
    """Per-layer table of the last checkpoint in the trends, and the contrast trends."""
    from qkgeom.analysis.e4.report import load_analysis
    from qkgeom.analysis.tables import layer_table
    from qkgeom.ui import render_layers

    analysis = load_analysis(out)
    metrics, ckpts, trends = analysis["metrics"], analysis["checkpoints"], analysis["trends"]
    last = ckpts[ckpts["in_trends"]].sort_values("step").iloc[-1]
    one = metrics[metrics["checkpoint"] == last["checkpoint"]]
    _, table = layer_table(one)
    table = table[[c for c in table.columns if not c.startswith("Δ")]]
    render_layers(table, f"{out} — {last['checkpoint']} (step {int(last['step'])}), "
                  f"{int(last['tokens']):,} tokens at {last['tokens_per_s']:,.0f} tokens/s")
    dups = ckpts[ckpts["duplicate_of"].notna()]
    for r in dups.itertuples():
        typer.echo(f"duplicate: {r.checkpoint} serves the same Q/K weights as {r.duplicate_of}"
                   + ("" if not r.in_trends else " (kept)"))
    tok = trends[trends["level"] == "token"]
    if len(tok) and tok["n"].max() >= 3:
        for r in tok.itertuples():
            regime = (f"early regime to step {int(r.regime_end_step)}" if r.has_regime
                      else "no early regime")
            typer.echo(f"layer {r.layer}: contrast ρ(step) {r.rho:+.2f}, Mann–Kendall Z "
                       f"{r.mk_z:+.2f}, {regime}" + (", decays after it" if r.decays else ""))


def register(app: typer.Typer) -> None:
    """Add ``analyze`` and ``export`` to the ``qkgeom`` app."""

    @app.command("analyze")
    def analyze_cmd(
        models: Annotated[list[str], typer.Argument(
            help="HF hub id, local HF folders (ordered by step), or a qkgeom run folder.")],
        revisions: Annotated[str | None, typer.Option(
            help="Comma-separated hub revisions (step0,step512,...), sub-folders of a local "
                 "folder, or steps of a run's checkpoints.")] = None,
        text: Annotated[str | None, typer.Option(
            help="sample | wikitext-103[:split] | a UTF-8 file or folder (default: sample; "
                 "a qkgeom run folder: the run's own probe set).")] = None,
        tokens: Annotated[int, typer.Option(help="Text tokens analysed per checkpoint.")]
            = 200_000,
        out: Annotated[Path | None, typer.Option(
            help="Analysis folder (default ckpt/<model>).")] = None,
        seq_len: Annotated[int | None, typer.Option(
            help="Window length (default: min(context, 512)).")] = None,
        batch_size: Annotated[int | None, typer.Option(help="Windows per forward.")] = None,
        qk_site: Annotated[str, typer.Option(
            help="post-rotary | pre-rotary: q/k for the token PRs.")] = "post-rotary",
        dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
        device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N | mps")] = "cpu",
        keep_duplicates: Annotated[bool, typer.Option(
            help="Keep checkpoints with identical Q/K weights in the trend statistics.")]
            = False,
        tokenizer: Annotated[str | None, typer.Option(
            help="Tokenizer to use (hub id or folder) if the checkpoints have none.")] = None,
        no_logit_spectrum: Annotated[bool, typer.Option(
            help="Skip pr_qk_token (the per-sequence logit spectrum).")] = False,
        trust_remote_code: Annotated[bool, typer.Option(
            help="Allow models with custom code from the hub.")] = False,
        quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    ) -> None:
        """Token-level Q/K geometry of checkpoints (E4): one at a time, cached, resumable."""
        from qkgeom.checkpoints.family import analyze_checkpoints
        from qkgeom.checkpoints.resolve import check_analysis_fits, resolve_checkpoints
        from qkgeom.runs.family import record_text_shortfall
        from qkgeom.training import resolve_device

        resolve_device(device)
        check_analysis_fits(resolve_checkpoints(models, _split(revisions)), text=text,
                            max_tokens=tokens, seq_len=seq_len, batch_size=batch_size,
                            dtype=dtype, device=device)
        folder = analyze_checkpoints(
            models, out or _default_out(models), revisions=_split(revisions), text=text,
            max_tokens=tokens, seq_len=seq_len, batch_size=batch_size, qk_site=qk_site,
            dtype=dtype, device=device, keep_duplicates=keep_duplicates, tokenizer=tokenizer,
            logit_spectrum=not no_logit_spectrum, trust_remote_code=trust_remote_code,
            progress=not quiet)
        short = record_text_shortfall(folder)
        if short:
            typer.echo(f"qkgeom: warning: {short}", err=True)
        _summary(folder)
        typer.echo(f"analysis folder: {folder}  (report: qkgeom report {folder})")

    @app.command("export")
    def export_cmd(
        run: Annotated[Path, typer.Argument(help="Run folder.")],
        out: Annotated[Path, typer.Option(help="Output folder (GPT2LMHeadModel format).")],
        step: Annotated[int | None, typer.Option(help="Checkpoint step (default: newest).")]
            = None,
    ) -> None:
        """Write a run's checkpoint as a Hugging Face GPT2LMHeadModel folder (+ char vocab)."""
        from qkgeom.checkpoints.export import export_run
        from qkgeom.runs import CONFIG

        if not (run / CONFIG).is_file():
            raise QKGeomError(f"{run}: not a qkgeom run folder (no config.json)")
        typer.echo(f"exported: {export_run(run, out, step)}")
