"""Analyse a family of checkpoints into an analysis folder, here or spread over workers.

Each checkpoint is loaded, hashed, measured and freed before the next (one model's memory
per worker) and cached as ``checkpoints/<name>.parquet`` plus ``.json``, the completion
marker written last, so an interrupted analysis resumes and only results of the same
settings are reused. Checkpoints serving identical Q/K weights are flagged ``duplicate_of``
the one with the largest step: weights may equal an earlier state, never a later one. The
folder's files: docs/definitions.md#analysis-folder; the statistics are the report's.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from qkgeom.errors import QKGeomError, require_whole
from qkgeom.io import LinkError, links_in, read_json, write_json, write_parquet
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

__all__ = ["CheckpointJob", "Executor", "analyze_checkpoints", "flag_duplicates", "measure_checkpoint"]

PROBE_SET = "probe-set"  # the ``text`` of an analysis on a run's own probe set
#: The columns of checkpoints.parquet before ``duplicate_of`` and ``in_trends``, in order.
ROW_COLUMNS = ("checkpoint", "step", "step_source", "kind", "source", "qk_hash", "arch",
               "n_head", "n_kv_head", "tokens", "seq_len", "blocks", "seconds", "tokens_per_s")


def flag_duplicates(table: pd.DataFrame, keep_duplicates: bool = False) -> pd.DataFrame:
    """Add ``duplicate_of`` and ``in_trends`` to a checkpoints table with ``checkpoint``,
    ``step`` and ``qk_hash`` (rule in the module docstring)."""
    out = table.copy()
    out["duplicate_of"] = None
    for _, grp in out.groupby("qk_hash", sort=False):
        keep = grp.sort_values("step", kind="stable").index[-1]
        for idx in grp.index:
            if idx != keep:
                out.loc[idx, "duplicate_of"] = out.loc[keep, "checkpoint"]
    out["in_trends"] = out["duplicate_of"].isna() | bool(keep_duplicates)
    return out


@dataclass(frozen=True)
class CheckpointJob:
    """Everything needed to measure one checkpoint into an analysis folder's cache, in any
    process (a Ray task, a pool worker): plain, picklable values only."""

    spec: CheckpointSpec
    out: str  # the analysis folder
    key: str  # its settings hash, written beside the cached result
    label: str  # the ``run_id`` column
    text: str | None  # an open_text spec; None: the run's own probe set
    max_tokens: int
    seq_len: int | None
    batch_size: int | None
    qk_site: str
    dtype: str
    device: str
    logit_spectrum: bool
    blocks: int
    tokenizer: str | None
    tokenizer_spec: CheckpointSpec  # the checkpoint whose tokenizer the family uses
    trust_remote_code: bool


#: ``executor(measure, jobs)``: runs ``measure(job)`` for every job somewhere, yielding
#: ``(job, row or exception)`` as each ends (``qkgeom.experiments.executors`` has Ray and
#: local-process ones).
Executor = Callable[[Callable[[CheckpointJob], dict[str, Any]], list[CheckpointJob]],
                  Iterable[tuple[CheckpointJob, "dict[str, Any] | BaseException"]]]


def analyze_checkpoints(
    models: list[str], out: str | Path, *, revisions: list[str] | None = None,
    text: str | None = None, max_tokens: int = 200_000, seq_len: int | None = None,
    batch_size: int | None = None, qk_site: str = "pre-rotary", dtype: str = "float32",
    device: str = "auto", keep_duplicates: bool = False, tokenizer: str | None = None,
    logit_spectrum: bool = True, trust_remote_code: bool = False, blocks: int = 8,
    progress: bool = False, executor: Executor | None = None,
) -> Path:
    """Analyse every checkpoint ``models`` and ``revisions`` name (``resolve_checkpoints``)
    into ``out`` with ``analyze_model``; returns ``out``. ``text`` (an ``open_text`` spec)
    defaults to ``sample``, except for a qkgeom run's checkpoints: they are measured on the
    run's own probe set in float64, exactly as its probes (``max_tokens``, ``seq_len``,
    ``batch_size`` and ``blocks`` then do not apply). ``executor`` (``make_executor``)
    measures what is not cached yet elsewhere; by default one checkpoint after another
    here. Bad input is a QKGeomError, before any model loads where possible
    (docs/checkpoints.md).
    """
    from qkgeom.checkpoints.resolve import check_analysis_fits, resolve_checkpoints
    from qkgeom.training import resolve_device

    _check_arguments(qk_site, max_tokens, blocks, batch_size, seq_len)
    device = str(resolve_device(device))
    out = Path(out)
    specs = resolve_checkpoints(models, revisions)
    check_analysis_fits(specs, text=text, max_tokens=max_tokens, seq_len=seq_len,
                        batch_size=batch_size, dtype=dtype, device=device)
    if text is None and specs[0].kind == "run":  # the run's own probe set
        max_tokens, blocks = int(_run_probe_set(Path(specs[0].source))[0].numel()), 1
    else:
        from qkgeom.data.text import open_text

        text = text or "sample"
        open_text(text)  # a bad --text fails here, before any model loads
    settings = {"text": text or PROBE_SET, "max_tokens": int(max_tokens), "seq_len": seq_len,
                "qk_site": qk_site, "dtype": dtype, "logit_spectrum": logit_spectrum,
                "tokenizer": tokenizer, "blocks": int(blocks),
                "sources": sorted({s.source for s in specs})}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    _claim(out, key)
    meta = _meta(models, revisions, specs, settings, key, keep_duplicates)
    write_json(out / MARKER, meta)
    job = CheckpointJob(spec=specs[0], out=str(out), key=key, label=meta["model"], text=text,
                        max_tokens=max_tokens, seq_len=seq_len, batch_size=batch_size,
                        qk_site=qk_site, dtype=dtype, device=device,
                        logit_spectrum=logit_spectrum, blocks=blocks, tokenizer=tokenizer,
                        tokenizer_spec=specs[0], trust_remote_code=trust_remote_code)
    results = _measure_all([replace(job, spec=spec) for spec in specs], executor, progress,
                           max_tokens, out)
    rows = [results[s.name][1] for s in specs]
    finish(out, [results[s.name][0] for s in specs], rows, keep_duplicates)
    meta["state"] = "done"
    write_json(out / MARKER, meta)
    for line in (record_text_shortfall(out), _fewer_blocks(rows, blocks)):
        if line:
            warnings.warn(line, stacklevel=2)
    return out


def _check_arguments(qk_site: str, max_tokens: int, blocks: int, batch_size: int | None,
                     seq_len: int | None) -> None:
    """The settings that need no model or text, checked first (named as on the CLI)."""
    from qkgeom.arch import QK_SITES

    if qk_site not in QK_SITES:
        raise QKGeomError(f"unknown --qk-site {qk_site!r}; choose one of {', '.join(QK_SITES)}")
    if max_tokens < 1:
        raise QKGeomError(f"--tokens must be >= 1, got {max_tokens}")
    require_whole("--blocks", blocks)
    for flag, value in (("--batch-size", batch_size), ("--seq-len", seq_len)):
        if value is not None:
            require_whole(flag, value)


def _claim(out: Path, key: str) -> None:
    """Refuse ``out`` unless it is new, empty, or an analysis with the same settings
    (``key``), which then resumes; never write through a planted link."""
    links = links_in(out)  # a planted link (checkpoints/ -> elsewhere) is never written through
    if links:
        raise LinkError(links[0])
    if (out / MARKER).is_file():
        prev = read_json(out / MARKER)
        if not isinstance(prev, dict):
            raise QKGeomError(f"{out / MARKER}: not a qkgeom analysis record (a JSON object "
                              f"is expected, got {type(prev).__name__}); use another --out")
        if prev.get("settings_hash") != key:
            raise QKGeomError(f"{out} holds an analysis with other settings "
                              f"({prev.get('settings', {})}); use another --out")
    elif out.exists() and any(out.iterdir()):
        raise QKGeomError(f"{out} exists, is not empty and is not an analysis folder; "
                          "choose another --out")


def _meta(models: list[str], revisions: list[str] | None, specs: list[CheckpointSpec],
          settings: dict[str, Any], key: str, keep_duplicates: bool) -> dict[str, Any]:
    """``analysis.json`` of a running analysis; its ``model`` (the hub model, else the
    folder's name) is the ``run_id`` of every row."""
    label = Path(models[0]).name if len(models) == 1 else Path(models[0]).parent.name or "local"
    return {"format_version": FORMAT_VERSION, "kind": "qkgeom-checkpoint-analysis",
            "model": specs[0].source if specs[0].kind == "hub" else label,
            "models": list(models), "revisions": revisions,
            "settings": settings, "settings_hash": key, "keep_duplicates": keep_duplicates,
            "checkpoints": [asdict(s) for s in specs], "state": "running",
            "warmup_steps": _warmup(specs),
            "versions": {"qkgeom": __version__, "python": platform.python_version()}}


def _measure_all(jobs: list[CheckpointJob], executor: Executor | None, progress: bool,
                 max_tokens: int, out: Path) -> dict[str, tuple[pd.DataFrame, dict[str, Any]]]:
    """``{name: (frame, row)}`` of every job: cached ones read back, the others measured
    here or through ``executor``, under a progress bar when asked."""
    results: dict[str, tuple[pd.DataFrame, dict[str, Any]]] = {}
    bar = None
    if progress:
        from qkgeom.ui import progress_bar

        bar = progress_bar("analyse", "{task.fields[ckpt]}", stderr=True)
        bar.start()
        task = bar.add_task("", total=len(jobs) * max_tokens, ckpt="")

    def show(**fields: Any) -> None:
        if bar is not None:
            bar.update(task, **fields)

    try:
        todo = []
        for job in jobs:
            cached = read_cached(job)
            if cached is None:
                todo.append(job)
            else:
                results[job.spec.name] = cached
                show(advance=max_tokens, ckpt=f"{job.spec.name} (cached)")
        if executor is None:
            _measure_here(todo, results, show)
        else:
            _measure_with(executor, todo, results, show, out)
    finally:
        if bar is not None:
            bar.stop()
    return results


def _fewer_blocks(rows: list[dict[str, Any]], asked: int) -> str | None:
    """One line when the text was too short for the token blocks asked for
    (:func:`qkgeom.checkpoints.analyze.fitting_blocks`); None when each got them all."""
    got = min((int(r.get("blocks", asked)) for r in rows), default=asked)
    if asked <= 1 or got >= asked:
        return None
    first = rows[0]
    text = (f"the text gave {int(first['tokens']):,} tokens, windows of up to "
            f"{int(first['seq_len'])}: too few for the {asked} token blocks asked for "
            "(--blocks); ")
    return text + (f"measured in {got} blocks instead" if got > 1 else
                   "measured without token blocks (the E4 bootstrap needs at least 2)")


def _warmup(specs: list[CheckpointSpec]) -> int | None:
    """Where a qkgeom run's LR warm-up ends, for E4's regime rule; None for other families
    (a suite's schedule is not recorded with its checkpoints)."""
    if specs[0].kind != "run":
        return None
    from qkgeom.runs import load_config

    return int(load_config(Path(specs[0].source)).warmup_steps)


def _cache(job: CheckpointJob) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", job.spec.name).strip("_") or "checkpoint"
    return Path(job.out) / CACHE / slug


def read_cached(job: CheckpointJob) -> tuple[pd.DataFrame, dict[str, Any]] | None:
    """A checkpoint's cached (frame, row), when it was measured with these settings."""
    cache = _cache(job)
    done_path = cache.with_suffix(".json")
    if not (done_path.is_file() and cache.with_suffix(".parquet").is_file()):
        return None
    done = read_json(done_path)
    if not isinstance(done, dict) or done.get("settings_hash") != job.key:
        return None
    return pd.read_parquet(cache.with_suffix(".parquet")), done["row"]


def _measure_here(jobs: list[CheckpointJob],
                  results: dict[str, tuple[pd.DataFrame, dict[str, Any]]],
                  show: Callable[..., None]) -> None:
    """One checkpoint after another in this process, the tokenizer loaded once."""
    tok = None
    for job in jobs:
        show(ckpt=job.spec.name)
        done = [0]  # tokens the bar advanced for this job

        def tick(n: int, done: list[int] = done) -> None:
            done[0] += n
            show(advance=n)

        frame, row, tok = _measure(job, tok, tick)
        results[job.spec.name] = (frame, row)
        if done[0] < job.max_tokens:
            show(advance=job.max_tokens - done[0])


def _measure_with(executor: Executor, jobs: list[CheckpointJob],
                  results: dict[str, tuple[pd.DataFrame, dict[str, Any]]],
                  show: Callable[..., None], out: Path) -> None:
    """The jobs through ``executor``; each result is read back from its cache entry. Every
    job runs even when some fail; then one line names the failures."""
    failed: list[str] = []
    for job, outcome in executor(measure_checkpoint, jobs):
        cached = None if isinstance(outcome, BaseException) else read_cached(job)
        if cached is None:
            why = ("no cache entry written" if not isinstance(outcome, BaseException)
                   else str(outcome) if isinstance(outcome, QKGeomError)
                   else f"{type(outcome).__name__}: {outcome}")
            failed.append(f"{job.spec.name}: {' '.join(why.split())[:200]}")
        else:
            results[job.spec.name] = cached
        show(advance=job.max_tokens, ckpt=job.spec.name)
    if failed:
        raise QKGeomError(f"{len(failed)} of {len(jobs)} checkpoint(s) failed ({failed[0]}"
                          + (f"; and {len(failed) - 1} more" if len(failed) > 1 else "")
                          + f"); the others are cached in {out / CACHE}: run the same "
                          "command again to measure only what is missing")


def measure_checkpoint(job: CheckpointJob) -> dict[str, Any]:
    """Measure one checkpoint and write its cache entry; returns its row of
    checkpoints.parquet. What a remote worker runs."""
    return _measure(job, None, None)[1]


def _measure(job: CheckpointJob, tok: Any, tick: Callable[[int], None] | None
             ) -> tuple[pd.DataFrame, dict[str, Any], Any]:
    """(frame, row, tokenizer) of one checkpoint, its cache entry written (the .json
    completion marker last). ``tok``: the family's tokenizer when already loaded."""
    from qkgeom.arch import adapter_for
    from qkgeom.checkpoints import analyze as analyze_mod
    from qkgeom.checkpoints.resolve import free_model, load_checkpoint, load_tokenizer, qk_hash
    from qkgeom.data.text import open_text

    spec = job.spec
    model, own_tok = load_checkpoint(spec, dtype=job.dtype, device=job.device,
                                     trust_remote_code=job.trust_remote_code)
    try:
        if own_tok is not None:
            tok = own_tok
        elif tok is None:
            tok = load_tokenizer(job.tokenizer_spec, job.tokenizer, job.trust_remote_code)
        digest = qk_hash(adapter_for(model))
        columns = {"run_id": job.label, "checkpoint": spec.name, "step": spec.step}
        if job.text is None:
            probe_ids, probe_batch = _run_probe_set(Path(spec.source))
            frame = _measure_probe_set(model, probe_ids, probe_batch, job.logit_spectrum,
                                       tick or (lambda n: None), **columns)
        else:
            frame = analyze_mod.analyze_model(
                model, tok, open_text(job.text), max_tokens=job.max_tokens,
                seq_len=job.seq_len, batch_size=job.batch_size, qk_site=job.qk_site,
                logit_spectrum=job.logit_spectrum, blocks=job.blocks, progress=tick,
                **columns)
    finally:
        free_model(model)
        model = None
    row = {"checkpoint": spec.name, "step": spec.step, "step_source": spec.step_source,
           "kind": spec.kind, "source": spec.source, "qk_hash": digest,
           **{k: frame.attrs[k] for k in ROW_COLUMNS[6:]}}
    cache = _cache(job)
    write_parquet(cache.with_suffix(".parquet"), frame)
    write_json(cache.with_suffix(".json"), {"settings_hash": job.key, "row": row})
    return frame, row, tok


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
    from qkgeom.checkpoints.analyze import analysis_frame
    from qkgeom.geometry import METRIC_NAMES, measure

    metrics = "all" if logit_spectrum else [m for m in METRIC_NAMES if m != "pr_qk_token"]
    result = measure(model, ids, metrics=metrics, batch_size=batch_size, **columns)
    progress(result.tokens)
    return analysis_frame(result, tokens=result.tokens, seq_len=int(ids.shape[1]),
                          qk_site="post-rotary", blocks=1, block_tokens=[])


def finish(out: Path, frames: list[pd.DataFrame], rows: list[dict[str, Any]],
           keep_duplicates: bool) -> None:
    """Write the combined tables of an analysis folder."""
    table = pd.DataFrame(rows)  # rows read back from a cache entry have sorted keys
    ckpts = flag_duplicates(table[[*ROW_COLUMNS, *(c for c in table if c not in ROW_COLUMNS)]],
                            keep_duplicates)
    metrics = pd.concat(frames, ignore_index=True)
    by_name = ckpts.set_index("checkpoint")
    metrics["duplicate_of"] = metrics["checkpoint"].map(by_name["duplicate_of"])
    metrics["in_trends"] = metrics["checkpoint"].map(by_name["in_trends"]).astype(bool)
    write_parquet(out / CHECKPOINT_TABLE, ckpts)
    write_parquet(out / "metrics.parquet", metrics)
