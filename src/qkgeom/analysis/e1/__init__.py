"""E1 and E2: the geometry of queries and keys during training, and what follows from it:
``trajectories`` (per-trajectory statistics), ``claims``, ``figures`` and ``report``.
"""

from qkgeom.analysis.e1.claims import CLAIMS, Claim, evaluate_claims

__all__ = ["CLAIMS", "Claim", "evaluate_claims"]
