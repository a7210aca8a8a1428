"""Analyse a family of checkpoints, one at a time, into an analysis folder.

Each checkpoint is loaded, hashed, analysed and freed before the next, so 150 revisions of
a 1B model need one model's memory. Its results go to ``DIR/checkpoints/<name>.parquet``
plus ``<name>.json`` (written last: the completion marker), so an interrupted analysis
resumes where it stopped; a cached result is reused only if it was made with the same
settings. The folder (``analysis.json`` marks it):

- ``analysis.json``: model, text, tokens, settings, state;
- ``metrics.parquet``: the run folder's long format ``run_id, checkpoint, step, layer,
  head, metric, value`` plus ``block`` (−1 = all tokens, k = token block k of the
  ``blocks`` contiguous blocks, the same at every checkpoint), ``duplicate_of`` (the
  checkpoint it duplicates, or None) and ``in_trends`` (False for a duplicate left out of
  trend statistics);
- ``checkpoints.parquet``: per checkpoint its step (and where it came from), Q/K hash,
  ``duplicate_of``, ``in_trends``, tokens and tokens/s.

The statistics over the family (trends, early regime, head correlations) are the report's
(:mod:`qkgeom.analysis.e4`): this folder holds measurements only.

Integrity: checkpoints serving identical Q/K weights under different names are grouped;
weights can legitimately equal an *earlier* state (no update happened, e.g. Pythia's step0
and step1) but never a *later* one, so in each group the checkpoint with the largest step
is kept and the others are flagged ``duplicate_of`` it and left out of trend statistics
unless ``keep_duplicates``.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from qkgeom.errors import QKGeomError
from qkgeom.io import read_json, write_json, write_parquet
from qkgeom.runs.family import (
    CACHE,
    CHECKPOINT_TABLE,
    FORMAT_VERSION,
    MARKER,
    record_text_shortfall,
)
from qkgeom.version import __version__

if TYPE_CHECKING:
    from qkgeom.checkpoints.resolve import CheckpointSpec

__all__ = ["analyze_checkpoints", "flag_duplicates"]

PROBE_SET = "probe-set"  # the ``text`` of an analysis on a run's own probe set


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "checkpoint"


def flag_duplicates(table: pd.DataFrame, keep_duplicates: bool = False) -> pd.DataFrame:
    """Add ``duplicate_of`` and ``in_trends`` to a checkpoints table with ``checkpoint``,
    ``step`` and ``qk_hash`` (rule in the module docstring)."""
    out = table.copy()
    out["duplicate_of"] = None
    for _, grp in out.groupby("qk_hash", sort=False):
        if len(grp) < 2:
            continue
        keep = grp.sort_values("step", kind="stable").index[-1]
        for idx in grp.index:
            if idx != keep:
                out.loc[idx, "duplicate_of"] = out.loc[keep, "checkpoint"]
    out["in_trends"] = out["duplicate_of"].isna() | bool(keep_duplicates)
    return out


def _settings(specs: list[CheckpointSpec], text: str, max_tokens: int, seq_len: int | None,
              qk_site: str, dtype: str, logit_spectrum: bool, tokenizer: str | None,
              blocks: int) -> dict[str, Any]:
    return {"text": text, "max_tokens": int(max_tokens), "seq_len": seq_len, "qk_site": qk_site,
            "dtype": dtype, "logit_spectrum": logit_spectrum, "tokenizer": tokenizer,
            "blocks": int(blocks), "sources": sorted({s.source for s in specs})}


def _hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def analyze_checkpoints(
    models: list[str],
    out: str | Path,
    *,
    revisions: list[str] | None = None,
    text: str | None = None,
    max_tokens: int = 200_000,
    seq_len: int | None = None,
    batch_size: int | None = None,
    qk_site: str = "pre-rotary",
    dtype: str = "float32",
    device: str = "cpu",
    keep_duplicates: bool = False,
    tokenizer: str | None = None,
    logit_spectrum: bool = True,
    trust_remote_code: bool = False,
    blocks: int = 8,
    progress: bool = False,
) -> Path:
    """Analyse every checkpoint of ``models``/``revisions`` into ``out``; returns ``out``.

    See :func:`qkgeom.checkpoints.resolve.resolve_checkpoints` for what ``models`` may
    be and :func:`qkgeom.checkpoints.analyze.analyze_model` for the analysis itself.
    ``text`` (a :func:`qkgeom.data.text.open_text` spec) defaults to ``sample``, except for
    the checkpoints of a qkgeom run folder: they are measured on the run's own probe set in
    float64, exactly as the trainer's probes, so the numbers equal the run's
    ``metrics.parquet`` (``max_tokens``, ``seq_len``, ``batch_size`` and ``blocks`` then do
    not apply). ``qk_site`` defaults to ``pre-rotary`` (rotary models also get the
    post-rotary PRs, ``pr_*_token_post``); ``blocks`` (default 8) token blocks are recorded
    beside all tokens for the E4 bootstrap.
    Raises :class:`QKGeomError` for bad input, before any model is loaded where possible.
    """
    from qkgeom.arch import QK_SITES, adapter_for
    from qkgeom.checkpoints.analyze import analyze_model
    from qkgeom.checkpoints.resolve import (
        check_analysis_fits,
        free_model,
        load_checkpoint,
        load_tokenizer,
        qk_hash,
        resolve_checkpoints,
    )
    from qkgeom.data.text import open_text

    if qk_site not in QK_SITES:
        raise QKGeomError(f"unknown --qk-site {qk_site!r}; choose one of {', '.join(QK_SITES)}")
    if max_tokens < 1:
        raise QKGeomError(f"--tokens must be >= 1, got {max_tokens}")
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
        raise QKGeomError(f"--blocks must be a whole number >= 1, got {blocks!r}")
    out = Path(out)
    specs = resolve_checkpoints(models, revisions)
    check_analysis_fits(specs, text=text, max_tokens=max_tokens, seq_len=seq_len,
                        batch_size=batch_size, dtype=dtype, device=device)
    probe_ids = None
    if text is None and specs[0].kind == "run":
        probe_ids, probe_batch = _run_probe_set(Path(specs[0].source))
        text, max_tokens, blocks = PROBE_SET, int(probe_ids.numel()), 1
    texts = open_text(text or "sample") if probe_ids is None else None
    settings = _settings(specs, text or "sample", max_tokens, seq_len, qk_site, dtype,
                         logit_spectrum, tokenizer, blocks)
    key = _hash(settings)
    if (out / MARKER).is_file():
        prev = read_json(out / MARKER)
        if prev.get("settings_hash") != key:
            raise QKGeomError(f"{out} holds an analysis with other settings "
                              f"({prev.get('settings', {})}); use another --out")
    elif out.exists() and any(out.iterdir()):
        raise QKGeomError(f"{out} exists, is not empty and is not an analysis folder; "
                          "choose another --out")
    label = Path(models[0]).name if len(models) == 1 else Path(models[0]).parent.name or "local"
    if specs[0].kind == "hub":
        label = specs[0].source
    meta = {"format_version": FORMAT_VERSION, "kind": "qkgeom-checkpoint-analysis",
            "model": label, "models": list(models), "revisions": revisions,
            "settings": settings, "settings_hash": key, "keep_duplicates": keep_duplicates,
            "checkpoints": [asdict(s) for s in specs], "state": "running",
            "versions": {"qkgeom": __version__, "python": platform.python_version()}}
    write_json(out / MARKER, meta)

    bar = task = None
    if progress:
        from qkgeom.ui import progress_bar

        bar = progress_bar("analyse", "{task.fields[ckpt]}", stderr=True)
        bar.start()
        task = bar.add_task("", total=len(specs) * max_tokens, ckpt="")
    frames, rows = [], []
    tok = None
    try:
        for spec in specs:
            cache = out / CACHE / _slug(spec.name)
            done_path = cache.with_suffix(".json")
            if done_path.is_file() and cache.with_suffix(".parquet").is_file():
                done = read_json(done_path)
                if done.get("settings_hash") == key:
                    frames.append(pd.read_parquet(cache.with_suffix(".parquet")))
                    rows.append(done["row"])
                    if bar is not None:
                        bar.update(task, advance=max_tokens, ckpt=f"{spec.name} (cached)")
                    continue
            if bar is not None:
                bar.update(task, ckpt=spec.name)
            model, own_tok = load_checkpoint(spec, dtype=dtype, device=device,
                                             trust_remote_code=trust_remote_code)
            try:
                if own_tok is not None:
                    tok = own_tok
                elif tok is None:
                    tok = load_tokenizer(spec, tokenizer, trust_remote_code)
                digest = qk_hash(adapter_for(model))
                advanced = 0

                def tick(n: int) -> None:
                    nonlocal advanced
                    advanced += n
                    if bar is not None:
                        bar.update(task, advance=n)

                columns = {"run_id": label, "checkpoint": spec.name, "step": spec.step}
                if probe_ids is not None:
                    frame = _measure_probe_set(model, probe_ids, probe_batch, logit_spectrum,
                                               tick, **columns)
                else:
                    frame = analyze_model(
                        model, tok, texts, max_tokens=max_tokens, seq_len=seq_len,
                        batch_size=batch_size, qk_site=qk_site, logit_spectrum=logit_spectrum,
                        blocks=blocks, progress=tick, **columns)
            finally:
                free_model(model)
                model = None
            if bar is not None and advanced < max_tokens:
                bar.update(task, advance=max_tokens - advanced)
            row = {"checkpoint": spec.name, "step": spec.step, "step_source": spec.step_source,
                   "kind": spec.kind, "source": spec.source, "qk_hash": digest,
                   "arch": frame.attrs["arch"], "n_head": frame.attrs["n_head"],
                   "n_kv_head": frame.attrs["n_kv_head"], "tokens": frame.attrs["tokens"],
                   "seq_len": frame.attrs["seq_len"], "blocks": frame.attrs["blocks"],
                   "seconds": frame.attrs["seconds"],
                   "tokens_per_s": frame.attrs["tokens_per_s"]}
            write_parquet(cache.with_suffix(".parquet"), frame)
            write_json(done_path, {"settings_hash": key, "row": row})
            frames.append(frame)
            rows.append(row)
    finally:
        if bar is not None:
            bar.stop()
    finish(out, frames, rows, keep_duplicates)
    meta["state"] = "done"
    write_json(out / MARKER, meta)
    short = record_text_shortfall(out)
    if short:
        warnings.warn(short, stacklevel=2)
    return out


def _run_probe_set(run: Path) -> tuple[Any, int]:
    """The probe set a run's trainer measured (token ids (n_seq, T)) and its probe batch."""
    from qkgeom.data import load_data, probe_set
    from qkgeom.runs import load_config, read_record

    cfg = load_config(run)
    data = load_data(read_record(run).get("data_dir") or cfg.data)
    return probe_set(data.val, cfg.probe_sequences, cfg.model.block_size), cfg.probe_batch


def _measure_probe_set(model: Any, ids: Any, batch_size: int, logit_spectrum: bool,
                       progress: Any, **columns: Any) -> pd.DataFrame:
    """A run checkpoint on the run's probe set, as the trainer measures it (float64)."""
    from qkgeom.geometry import METRIC_NAMES, measure

    metrics = "all" if logit_spectrum else [m for m in METRIC_NAMES if m != "pr_qk_token"]
    result = measure(model, ids, metrics=metrics, batch_size=batch_size, **columns)
    progress(result.tokens)
    frame = result.frame
    frame["block"] = pd.Series([-1] * len(frame), dtype="int64")  # blocks do not apply
    site = result.adapter.sites[0]
    frame.attrs.update(arch=result.adapter.arch, tokens=result.tokens,
                       positions=result.tokens, seconds=result.seconds,
                       tokens_per_s=result.tokens / max(result.seconds, 1e-9),
                       seq_len=int(ids.shape[1]), n_head=site.n_head, n_kv_head=site.n_kv_head,
                       causal=True, rotary=False, qk_site="post-rotary", blocks=1,
                       block_tokens=[])
    return frame


def finish(out: Path, frames: list[pd.DataFrame], rows: list[dict[str, Any]],
           keep_duplicates: bool) -> None:
    """Write the combined tables of an analysis folder."""
    ckpts = flag_duplicates(pd.DataFrame(rows), keep_duplicates)
    metrics = pd.concat(frames, ignore_index=True)
    by_name = ckpts.set_index("checkpoint")
    metrics["duplicate_of"] = metrics["checkpoint"].map(by_name["duplicate_of"])
    metrics["in_trends"] = metrics["checkpoint"].map(by_name["in_trends"]).astype(bool)
    write_parquet(out / CHECKPOINT_TABLE, ckpts)
    write_parquet(out / "metrics.parquet", metrics)
