"""Experiment E4: Q/K geometry across a family of checkpoints (hub revisions, local HF
folders, the project's own run), measured one checkpoint at a time, cached, resumable.

::

    from qkgeom.checkpoints import analyze_model
    table = analyze_model(model, tokenizer, texts, max_tokens=200_000)  # long DataFrame

    from qkgeom.checkpoints import analyze_checkpoints
    analyze_checkpoints(["EleutherAI/pythia-160m"], "ckpt/pythia160m",
                        revisions=["step0", "step512", "step143000"])
    # then qkgeom.analysis.write_report("ckpt/pythia160m"): trends, early regime, E4 claims

Modules: ``resolve`` (which checkpoints, their steps, loading, Q/K hashes), ``analyze``
(one model over a corpus, through :func:`qkgeom.geometry.measure_batches`), ``family``
(a family into an analysis folder, cached and resumable), ``export`` (our runs as
``GPT2LMHeadModel`` folders). The statistics and the report are :mod:`qkgeom.analysis.e4`'s.
Names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkgeom._lazy import lazy_getattr

_EXPORTS = {
    "analyze_model": "qkgeom.checkpoints.analyze",
    "analyze_checkpoints": "qkgeom.checkpoints.family",
    "resolve_checkpoints": "qkgeom.checkpoints.resolve",
    "load_run_model": "qkgeom.checkpoints.resolve",
    "export_run": "qkgeom.checkpoints.export",
}

__all__ = ["analyze_checkpoints", "analyze_model", "export_run", "load_run_model",
           "resolve_checkpoints"]

if TYPE_CHECKING:
    from qkgeom.checkpoints.analyze import analyze_model
    from qkgeom.checkpoints.export import export_run
    from qkgeom.checkpoints.family import analyze_checkpoints
    from qkgeom.checkpoints.resolve import load_run_model, resolve_checkpoints


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
