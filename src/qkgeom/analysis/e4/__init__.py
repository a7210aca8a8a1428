"""E4: token-level Q/K geometry across the checkpoints of a model family.

Reads the analysis folder ``qkgeom analyze`` writes (:mod:`qkgeom.runs.family`), or a set
of them, one per seed (``qkgeom reproduce e4``): ``regime`` (the regime call of one layer:
a rise and a fall, each against what noise gives a monotone curve), ``trends``
(Mann–Kendall, the per-layer table, across-head correlations), ``bootstrap`` (the
token-block bootstrap of the calls), ``claims`` (E4.1–E4.4, for one model or over seeds),
``figures`` (matplotlib, imported only to draw) and ``report``.
"""

from qkgeom.analysis.e4.bootstrap import block_bootstrap
from qkgeom.analysis.e4.claims import e4_claims, seed_claims
from qkgeom.analysis.e4.regime import regime_calls
from qkgeom.analysis.e4.trends import head_correlations, prefix_trends, trend_table

__all__ = ["block_bootstrap", "e4_claims", "head_correlations", "prefix_trends",
           "regime_calls", "seed_claims", "trend_table"]
