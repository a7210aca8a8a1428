"""Experiment E4: Q/K geometry across a family of checkpoints (hub revisions, local HF
folders, the project's own run), measured one checkpoint at a time, cached, resumable.

``resolve`` (which checkpoints, their steps, loading, Q/K hashes), ``analyze`` (one model
over a corpus), ``family`` (a family into an analysis folder) and ``export`` (our runs as
``GPT2LMHeadModel`` folders); the statistics and the report are :mod:`qkgeom.analysis.e4`'s.
Names load on first use. Usage: docs/checkpoints.md.
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
