"""E3: key-spectrum control during training, runs paired by seed.

``paired`` (paired differences, window means, effects with directional confidence, the
E3 claims), ``figures`` (matplotlib, imported only to draw) and ``report``.
"""

from qkgeom.analysis.e3.paired import (
    E3_CLAIMS,
    e3_analysis,
    evaluate_e3_claims,
    is_e3,
    paired_differences,
    seed_bootstrap,
)

__all__ = ["E3_CLAIMS", "e3_analysis", "evaluate_e3_claims", "is_e3", "paired_differences",
           "seed_bootstrap"]
