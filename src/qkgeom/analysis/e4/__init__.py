"""E4: token-level Q/K geometry across the checkpoints of a model family.

Reads the analysis folder ``qkgeom analyze`` writes (:mod:`qkgeom.runs.family`):
``trends`` (Mann–Kendall, the regime call per layer, the share of the gain lost,
across-head correlations), ``bootstrap`` (the token-block bootstrap of the calls),
``claims`` (E4.1–E4.4), ``figures`` (matplotlib, imported only to draw) and ``report``.
"""

from qkgeom.analysis.e4.bootstrap import block_bootstrap
from qkgeom.analysis.e4.claims import e4_claims
from qkgeom.analysis.e4.trends import head_correlations, prefix_trends, regime_calls, trend_table

__all__ = ["block_bootstrap", "e4_claims", "head_correlations", "prefix_trends",
           "regime_calls", "trend_table"]
