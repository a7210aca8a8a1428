"""E1 and E2: the geometry of queries and keys during training, and what follows from it.

``claims`` (the claims and their evaluation on per-trajectory statistics), ``figures``
(matplotlib, imported only to draw) and ``report`` (the report of a sweep or one run
folder). Definitions: docs/definitions.md; statistics and verdicts: docs/report.md.
"""

from qkgeom.analysis.e1.claims import CLAIMS, Claim, evaluate_claims

__all__ = ["CLAIMS", "Claim", "evaluate_claims"]
