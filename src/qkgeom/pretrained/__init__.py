"""Token-level Q/K geometry of pretrained checkpoints (SPEC §5, experiment E4).

::

    from qkgeom.pretrained import analyze_model
    table = analyze_model(model, tokenizer, texts, max_tokens=200_000)  # long DataFrame

    from qkgeom.pretrained import analyze_checkpoints, write_e4_report
    analyze_checkpoints(["EleutherAI/pythia-160m"], "ckpt/pythia160m",
                        revisions=["step0", "step512", "step143000"])
    write_e4_report("ckpt/pythia160m")                                  # report/report.md

Modules: ``adapters`` (where q/k live per architecture, capture hooks), ``entropy``
(online-softmax attention entropy), ``accumulate`` (per-layer streamed metrics),
``text`` (corpora and token windows), ``analyze`` (one model), ``checkpoints`` (lists,
steps, loading, Q/K hashes), ``family`` (a family of checkpoints, cached and resumable),
``trends`` / ``claims`` / ``figures`` / ``report`` (statistics, E4 claims, report; no
torch), ``export`` (our runs as ``GPT2LMHeadModel`` folders). Names load on first use, so
the report side never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkgeom._lazy import lazy_getattr

_EXPORTS = {
    "analyze_model": "qkgeom.pretrained.analyze",
    "find_attention_sites": "qkgeom.pretrained.adapters",
    "capture_qk": "qkgeom.pretrained.adapters",
    "StreamingEntropy": "qkgeom.pretrained.entropy",
    "LayerGeometry": "qkgeom.pretrained.accumulate",
    "analyze_checkpoints": "qkgeom.pretrained.family",
    "resolve_checkpoints": "qkgeom.pretrained.checkpoints",
    "load_run_model": "qkgeom.pretrained.checkpoints",
    "mann_kendall": "qkgeom.pretrained.trends",
    "trend_table": "qkgeom.pretrained.trends",
    "e4_claims_table": "qkgeom.pretrained.report",
    "write_e4_report": "qkgeom.pretrained.report",
    "export_run": "qkgeom.pretrained.export",
}

__all__ = [
    "LayerGeometry", "StreamingEntropy", "analyze_checkpoints", "analyze_model", "capture_qk",
    "e4_claims_table", "export_run", "find_attention_sites", "load_run_model", "mann_kendall",
    "resolve_checkpoints", "trend_table", "write_e4_report",
]

if TYPE_CHECKING:
    from qkgeom.pretrained.accumulate import LayerGeometry
    from qkgeom.pretrained.adapters import capture_qk, find_attention_sites
    from qkgeom.pretrained.analyze import analyze_model
    from qkgeom.pretrained.checkpoints import load_run_model, resolve_checkpoints
    from qkgeom.pretrained.entropy import StreamingEntropy
    from qkgeom.pretrained.export import export_run
    from qkgeom.pretrained.family import analyze_checkpoints
    from qkgeom.pretrained.report import e4_claims_table, write_e4_report
    from qkgeom.pretrained.trends import mann_kendall, trend_table


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
