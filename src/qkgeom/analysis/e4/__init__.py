"""E4: token-level Q/K geometry across the checkpoints of a model family, from the analysis
folder ``qkgeom analyze`` writes or a set of them, one per seed (``qkgeom reproduce e4``):
``regime`` (the call of one layer), ``trends`` (the per-layer table, Mann–Kendall,
across-head ρ), ``bootstrap`` (token blocks), ``claims``, ``labels``, ``figures``, ``report``.
"""

from qkgeom.analysis.e4.bootstrap import block_bootstrap
from qkgeom.analysis.e4.claims import e4_claims, seed_claims
from qkgeom.analysis.e4.regime import regime_calls
from qkgeom.analysis.e4.trends import head_correlations, prefix_trends, trend_table

__all__ = ["block_bootstrap", "e4_claims", "head_correlations", "prefix_trends",
           "regime_calls", "seed_claims", "trend_table"]
