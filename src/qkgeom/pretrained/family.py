"""Analyse a family of checkpoints, one at a time, into an analysis folder.

Each checkpoint is loaded, hashed, analysed and freed before the next, so 150 revisions of
a 1B model need one model's memory. Its results go to ``DIR/checkpoints/<name>.parquet``
plus ``<name>.json`` (written last: the completion marker), so an interrupted analysis
resumes where it stopped; a cached result is reused only if it was made with the same
settings. The folder (``analysis.json`` marks it):

- ``analysis.json``: model, text, tokens, settings, state;
- ``metrics.parquet``: SPEC §7 long format ``run_id, checkpoint, step, layer, head,
  metric, value`` plus ``duplicate_of`` (the checkpoint it duplicates, or None) and
  ``in_trends`` (False for a duplicate left out of trend statistics);
- ``checkpoints.parquet``: per checkpoint its step (and where it came from), Q/K hash,
  ``duplicate_of``, ``in_trends``, tokens and tokens/s;
- ``trends.parquet``, ``prefix_trends.parquet``, ``head_correlations.parquet``: the
  statistics of :mod:`qkgeom.pretrained.trends`.

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
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from qkgeom import __version__
from qkgeom.errors import QKGeomError
from qkgeom.io import read_json, write_json, write_parquet

if TYPE_CHECKING:
    from qkgeom.pretrained.checkpoints import CheckpointSpec

__all__ = ["MARKER", "analyze_checkpoints", "flag_duplicates", "is_analysis_folder"]

MARKER = "analysis.json"
FORMAT_VERSION = 1


def is_analysis_folder(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


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
              qk_site: str, dtype: str, logit_spectrum: bool, tokenizer: str | None
              ) -> dict[str, Any]:
    return {"text": text, "max_tokens": int(max_tokens), "seq_len": seq_len, "qk_site": qk_site,
            "dtype": dtype, "logit_spectrum": logit_spectrum, "tokenizer": tokenizer,
            "sources": sorted({s.source for s in specs})}


def _hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def analyze_checkpoints(
    models: list[str],
    out: str | Path,
    *,
    revisions: list[str] | None = None,
    text: str = "sample",
    max_tokens: int = 200_000,
    seq_len: int | None = None,
    batch_size: int | None = None,
    qk_site: str = "post-rotary",
    dtype: str = "float32",
    device: str = "cpu",
    keep_duplicates: bool = False,
    tokenizer: str | None = None,
    logit_spectrum: bool = True,
    trust_remote_code: bool = False,
    progress: bool = False,
) -> Path:
    """Analyse every checkpoint of ``models``/``revisions`` into ``out``; returns ``out``.

    See :func:`qkgeom.pretrained.checkpoints.resolve_checkpoints` for what ``models`` may
    be and :func:`qkgeom.pretrained.analyze.analyze_model` for the analysis itself.
    Raises :class:`QKGeomError` for bad input, before any model is loaded where possible.
    """
    from qkgeom.pretrained.adapters import QK_SITES, find_attention_sites
    from qkgeom.pretrained.analyze import analyze_model
    from qkgeom.pretrained.checkpoints import (
        free_model,
        load_checkpoint,
        load_tokenizer,
        qk_hash,
        resolve_checkpoints,
    )
    from qkgeom.pretrained.text import open_text

    if qk_site not in QK_SITES:
        raise QKGeomError(f"unknown --qk-site {qk_site!r}; choose one of {', '.join(QK_SITES)}")
    if max_tokens < 1:
        raise QKGeomError(f"--tokens must be >= 1, got {max_tokens}")
    out = Path(out)
    specs = resolve_checkpoints(models, revisions)
    texts = open_text(text)
    settings = _settings(specs, text, max_tokens, seq_len, qk_site, dtype, logit_spectrum,
                         tokenizer)
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
            cache = out / "checkpoints" / _slug(spec.name)
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
                adapter = find_attention_sites(model)
                digest = qk_hash(adapter)
                advanced = 0

                def tick(n: int) -> None:
                    nonlocal advanced
                    advanced += n
                    if bar is not None:
                        bar.update(task, advance=n)

                frame = analyze_model(
                    model, tok, texts, max_tokens=max_tokens, seq_len=seq_len,
                    batch_size=batch_size, qk_site=qk_site, logit_spectrum=logit_spectrum,
                    progress=tick, run_id=label, checkpoint=spec.name, step=spec.step)
            finally:
                free_model(model)
                model = None
            if bar is not None and advanced < max_tokens:
                bar.update(task, advance=max_tokens - advanced)
            row = {"checkpoint": spec.name, "step": spec.step, "step_source": spec.step_source,
                   "kind": spec.kind, "source": spec.source, "qk_hash": digest,
                   "arch": frame.attrs["arch"], "n_head": frame.attrs["n_head"],
                   "n_kv_head": frame.attrs["n_kv_head"], "tokens": frame.attrs["tokens"],
                   "seq_len": frame.attrs["seq_len"], "seconds": frame.attrs["seconds"],
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
    return out


def finish(out: Path, frames: list[pd.DataFrame], rows: list[dict[str, Any]],
           keep_duplicates: bool) -> None:
    """Write the combined tables and the trajectory statistics of an analysis folder."""
    from qkgeom.pretrained.trends import head_correlations, prefix_trends, trend_table

    ckpts = flag_duplicates(pd.DataFrame(rows), keep_duplicates)
    metrics = pd.concat(frames, ignore_index=True)
    by_name = ckpts.set_index("checkpoint")
    metrics["duplicate_of"] = metrics["checkpoint"].map(by_name["duplicate_of"])
    metrics["in_trends"] = metrics["checkpoint"].map(by_name["in_trends"]).astype(bool)
    write_parquet(out / "checkpoints.parquet", ckpts)
    write_parquet(out / "metrics.parquet", metrics)
    used = metrics[metrics["in_trends"]]
    write_parquet(out / "trends.parquet", trend_table(used))
    write_parquet(out / "prefix_trends.parquet", prefix_trends(used))
    write_parquet(out / "head_correlations.parquet", head_correlations(used))
